"""training/flop_model.py: attention FLOPs from the documents of a batch, the chip table, refusing MFU > 100 %, and
the trainer's logged MFU on a tiny CPU run (a peak mocked for the CPU)."""
import json

import jax
import numpy as np
import pytest

from mixerlab.pallas_kernels import chips
from mixerlab.training import flop_model
from mixerlab.training.config import load_config


def _brute_pairs(seg) -> int:
    """Pairs (query i, key j ≤ i) with no change of id between j and i and a non-zero id: counted one by one."""
    total = 0
    for row in np.asarray(seg):
        for i in range(len(row)):
            j = i
            while j >= 0 and row[j] == row[i] and row[i] != 0:
                total += 1
                j -= 1
    return total


@pytest.mark.parametrize("rows", [
    [[1] * 8, [1] * 8],                                  # one document per row: T(T+1)/2 each
    [[1, 1, 1, 2, 2, 3, 3, 3], [1, 2, 3, 4, 5, 6, 7, 8]],  # short documents; one token each
    [[1, 1, 2, 2, 1, 1, 3, 3], [2, 2, 2, 1, 1, 1, 1, 2]],  # ids that do not increase: a change starts a document
    [[1, 1, 1, 1, 1, 0, 0, 0], [0] * 8],                 # padding (id 0) attends to nothing
])
def test_causal_pairs_count_within_document_pairs(rows):
    seg = np.asarray(rows, np.int32)
    want = _brute_pairs(seg)
    assert float(flop_model.causal_pairs(seg)) == want
    assert float(jax.jit(flop_model.causal_pairs)(seg)) == want


def test_causal_pairs_by_hand():
    # 2 rows of 8: one document (36 pairs); documents of 3, 2, 3 (6 + 3 + 6 = 15)
    assert float(flop_model.causal_pairs(np.array([[1] * 8], np.int32))) == 8 * 9 / 2 == \
        flop_model.full_row_pairs(1, 8)
    assert float(flop_model.causal_pairs(np.array([[1, 1, 1, 2, 2, 3, 3, 3]], np.int32))) == 15
    # 1,1,2,2,1,1: three documents of 2 (the second 1-run is a new document), not one of 4 and one of 2
    assert float(flop_model.causal_pairs(np.array([[1, 1, 2, 2, 1, 1]], np.int32))) == 9


def test_transformer_step_flops_one_document_per_row_is_the_old_formula():
    cfg = load_config("configs/tiny.yaml", ["model.mixer=softmax", "data.seq_len=64"])
    params = {"w": jax.ShapeDtypeStruct((64, 128), np.float32)}
    count = flop_model.training_flops(cfg, params, 256)
    h, dh, layers, t, b = cfg.model.num_heads, cfg.head_dim, cfg.model.num_layers, 64, 4
    assert count.per_token == 6 * 64 * 128 and count.core_per_token == 0
    assert count.per_attention_pair == layers * 6 * h * (dh + dh)
    seg = np.ones((b, t), np.int32)
    full = count.step_flops(b * t, float(flop_model.causal_pairs(seg)))
    # the earlier per-token count 6·T·H·D_h per layer, with the exact T(T+1)/2 pairs in place of T²/2
    assert full == pytest.approx(b * t * (6 * 64 * 128 + layers * 6 * (t + 1) * h * dh), rel=1e-12)
    short = np.repeat(np.arange(1, 9, dtype=np.int32), 8)[None].repeat(b, 0)  # 8 documents of 8 per row
    assert count.step_flops(b * t, float(flop_model.causal_pairs(short))) == \
        b * t * 6 * 64 * 128 + count.per_attention_pair * b * 8 * 36


def test_recurrent_mixers_have_no_attention_pairs():
    cfg = load_config("configs/tiny.yaml", ["model.mixer=gdn2"])
    count = flop_model.training_flops(cfg, {}, 256)
    assert count.per_attention_pair == 0 and count.core_per_token > 0
    assert count.step_flops(100, 1e9) == count.step_flops(100, 0)


@pytest.mark.parametrize("mixer", ["linear_attention", "mamba2", "retnet", "gla", "hgrn2"])
def test_no_erase_mixers_count_the_no_erase_kernel(mixer):
    """Linear attention, Mamba-2, RetNet, GLA and HGRN2 run the delta-rule op without an erase key: their core is
    the no-erase kernel's count at their head shape (no A, inverse or solve: fewer FLOPs than a delta mixer of the
    same shape), never a silent 0, and no note."""
    from mixerlab.pallas_kernels.delta_rule import flops as kernel_flops

    over = ["model.num_heads=4", "model.head_dim=16", "model.value_head_dim=32", "data.seq_len=64"]
    cfg = load_config("configs/tiny.yaml", [f"model.mixer={mixer}", *over])
    core, note = flop_model.core_flops_per_token(cfg, mixer, 64)
    per_head = {}
    for erase in (True, False):
        kc = kernel_flops.KernelConfig(chunk=64, leaf=8, d_k=16, d_v=32, has_erase=erase)
        per_head[erase] = (kernel_flops.total(kernel_flops.forward_stages(kc)).mxu
                           + kernel_flops.total(kernel_flops.backward_stages(kc)).mxu)
    assert core == 4 * per_head[False] > 0 and per_head[False] < per_head[True]
    assert note is None
    delta, _ = flop_model.core_flops_per_token(cfg, "gdn2", 64)
    assert delta == 4 * per_head[True]
    count = flop_model.training_flops(cfg, {}, 256)
    assert count.core_per_token == cfg.model.num_layers * core and count.per_attention_pair == 0
    assert count.notes == ()


@pytest.mark.parametrize("kind, name, peak, measured", [
    ("NVIDIA H200", "H200", 989e12, 790e12), ("NVIDIA H100 80GB HBM3", "H100 SXM", 989e12, None),
    ("NVIDIA H100 PCIe", "H100 PCIe", 756e12, None), ("NVIDIA A100-SXM4-80GB", "A100", 312e12, None),
    ("TPU v4", "v4", 275e12, None), ("TPU v5 lite", "v5e", 197e12, None), ("TPU v5", "v5p", 459e12, None),
    ("TPU v6 lite", "v6e", 918e12, None)])
def test_chip_table_by_device_kind(kind, name, peak, measured):
    chip = chips.by_device_kind(kind)
    assert (chip.name, chip.bf16_peak, chip.measured_bf16) == (name, peak, measured)
    assert chips.by_name(name) is chip


def test_unknown_devices_have_no_peak():
    assert chips.by_device_kind("cpu") is None
    assert chips.by_device_kind("NVIDIA H200 NVL") is None  # another product: no substring guess
    assert flop_model.device_chip() is None  # the test machine's CPU
    use = flop_model.utilisation(2e12, 1.0, 1, None, "tiny")
    assert use == {"model_tflops_per_s": 2.0}


def test_utilisation_against_the_datasheet_and_the_measured_peak():
    h200 = chips.by_name("H200")
    use = flop_model.utilisation(0.5 * 989e12 * 2 * 0.1, 0.1, 2, h200, "run")
    assert use["mfu"] == pytest.approx(0.5) and use["mfu_measured_peak"] == pytest.approx(0.5 * 989 / 790)
    assert "mfu_measured_peak" not in flop_model.utilisation(1e12, 1.0, 1, chips.by_name("v5e"), "run")


def test_mfu_above_100_percent_is_refused_with_the_config_and_flop_count():
    with pytest.raises(flop_model.ImpossibleMFU, match=r"transformer_166m 32768x4: MFU 141\.0 % .*1\.3945e\+14 model"):
        flop_model.utilisation(1.41 * 989e12 * 0.1, 0.1, 1, chips.by_name("H200"), "transformer_166m 32768x4")


def test_trainer_logs_mfu_from_each_batchs_documents(tmp_path, monkeypatch, capsys):
    """log_every=1: each row is one step, so its model TFLOP/s × step time is that step's FLOP count, which
    must be the batch's within-document attention plus the per-token FLOPs (not T(T+1)/2 per row)."""
    from mixerlab.training import data as data_lib
    from mixerlab.training.loop import train
    from mixerlab.training.tokenizer import load_tokenizer

    fake = chips.Chip("fake", ("cpu",), 1e14, 5e13, None, None, "test")
    monkeypatch.setattr(flop_model, "device_chip", lambda device=None: fake)
    cfg = load_config("configs/tiny.yaml", [f"train.output_dir={tmp_path / 'run'}", "model.num_layers=1",
                                            "train.steps=2", "train.log_every=1",
                                            "train.eval_every=0", "checkpoint.every=0", "optim.warmup_steps=1"])
    result = train(cfg, progress=False)
    rows = [r for r in map(json.loads, open(result.metrics_path)) if r["split"] == "train"]
    tok = load_tokenizer(cfg.data.tokenizer.kind, cfg.data.tokenizer.path)
    batches = data_lib.train_iterator(cfg.data, tok, global_batch_size=cfg.train.batch_size, seed=cfg.train.seed)
    from mixerlab.training.loop import Trainer

    count = flop_model.training_flops(cfg, Trainer(cfg, tok.vocab_size).abstract_params, tok.vocab_size)
    tokens = cfg.train.batch_size * cfg.data.seq_len
    short_documents = False
    for row in rows:
        pairs = _brute_pairs(next(batches)["segment_ids"])
        short_documents |= pairs < flop_model.full_row_pairs(cfg.train.batch_size, cfg.data.seq_len)
        flops = row["model_tflops_per_s"] * 1e12 * row["step_time_s"]
        assert flops == pytest.approx(count.step_flops(tokens, pairs), rel=1e-5)
        assert row["mfu"] == pytest.approx(row["model_tflops_per_s"] * 1e12 / 1e14, rel=1e-9)
        assert row["mfu_measured_peak"] == pytest.approx(2 * row["mfu"], rel=1e-9)
    assert len(rows) == 2 and short_documents  # the embedded corpus packs several documents into a row


def test_trainer_refuses_an_mfu_above_100_percent(tmp_path, monkeypatch, capsys):
    """A peak the steps beat: the MFU is not logged and the error is said once, naming the run and its FLOPs;
    the run goes on."""
    from mixerlab.training.loop import train

    slow = chips.Chip("slow", ("cpu",), 1.0, None, None, None, "test")
    monkeypatch.setattr(flop_model, "device_chip", lambda device=None: slow)
    cfg = load_config("configs/tiny.yaml", [f"train.output_dir={tmp_path / 'slow'}", "model.num_layers=1",
                                            "train.steps=2", "train.log_every=1", "train.eval_every=0",
                                            "checkpoint.every=0", "optim.warmup_steps=1"])
    result = train(cfg, progress=False)
    rows = [r for r in map(json.loads, open(result.metrics_path)) if r["split"] == "train"]
    assert len(rows) == 2 and all("mfu" not in r and r["model_tflops_per_s"] > 0 for r in rows)
    out = capsys.readouterr().out
    assert out.count("is above 100 %") == 1 and "model FLOPs per step" in out and str(tmp_path / "slow") in out

