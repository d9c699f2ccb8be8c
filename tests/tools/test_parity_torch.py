"""tools/parity_torch.py without torch: its schedule for torch equals the trainer's, and mixerlab's own runs (the
float32/bfloat16/seed pairs) produce the curves and summary the GPU call reports."""
import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "tools"))

import parity_torch  # noqa: E402

TINY = ["--set", "model.num_layers=1", "--set", "model.d_model=32", "--set", "model.num_heads=2", "--set",
        "model.ffn_dim=64", "--set", "data.seq_len=32", "--set", "train.batch_size=2", "--set", "optim.warmup_steps=2"]


@pytest.mark.parametrize("steps,warmup", [(12, 3), (5, 4), (40, 0)])
def test_torch_schedule_is_the_trainers(steps, warmup):
    from mixerlab.training.optim import schedule

    args = parity_torch.parse_args(["--mixer", "softmax", "--out", "x", "--steps", str(steps), "--window", "1,1",
                                    "--set", f"optim.warmup_steps={warmup}"])
    cfg = parity_torch.config(args)
    factor, lr = parity_torch.torch_schedule(cfg), schedule(cfg)
    for step in range(steps + 2):
        assert factor(step) * cfg.optim.lr == pytest.approx(float(lr(step)), rel=1e-6, abs=1e-12), step


def test_our_runs_write_curves_and_summary(tmp_path, capsys):
    out = tmp_path / "p"
    args = ["--mixer", "softmax", "--steps", "3", "--window", "2,3", "--out", str(out), *TINY]
    assert parity_torch.main([*args, "--runs", "ours_f32,ours_bf16"]) == 0
    first = json.load(open(out / "parity.json"))
    assert set(first["curves"]) == {"ours_f32", "ours_bf16"} and all(len(c) == 3 for c in first["curves"].values())
    assert "ours_bf16_minus_ours_f32_mean" in first["summary"] and os.path.isfile(out / "parity.png")
    os.replace(out / "parity.json", tmp_path / "first.json")
    # a later call joins the earlier curves when batches and initial weights are the same ones
    assert parity_torch.main([*args, "--runs", "ours_f32_seed1", "--previous", str(tmp_path / "first.json")]) == 0
    joined = json.load(open(out / "parity.json"))
    assert set(joined["curves"]) == {"ours_f32", "ours_bf16", "ours_f32_seed1"}
    assert joined["batches_sha"] == first["batches_sha"] and joined["init_sha"] == first["init_sha"]
    assert "seed_spread_f32_mean_abs" in joined["summary"]
    with pytest.raises(SystemExit, match="other batches or initial weights"):
        parity_torch.main([*args, "--runs", "ours_f32", "--set", "train.seed=3", "--previous",
                           str(tmp_path / "first.json")])
    # --merge: files written by parallel processes become one summary; other weights are refused
    merged_dir = tmp_path / "m"
    assert parity_torch.main(["--mixer", "softmax", "--steps", "3", "--window", "2,3", "--out", str(merged_dir),
                              "--merge", str(tmp_path / "first.json"), str(out / "parity.json")]) == 0
    merged = json.load(open(merged_dir / "parity.json"))
    assert merged["curves"] == joined["curves"] and merged["summary"] == joined["summary"]
    # how the torch side ran comes from the part that has torch runs, whatever the order of the files
    torch_part = {**first, "curves": {"torch_f32": first["curves"]["ours_f32"]}, "torch_f32_dots": "tf32x3"}
    json.dump(torch_part, open(tmp_path / "torch.json", "w"))
    assert parity_torch.main(["--mixer", "softmax", "--steps", "3", "--window", "2,3", "--out", str(merged_dir),
                              "--merge", str(tmp_path / "torch.json"), str(out / "parity.json")]) == 0
    assert json.load(open(merged_dir / "parity.json"))["torch_f32_dots"] == "tf32x3"
    other = {**first, "init_sha": "0" * 16}
    json.dump(other, open(tmp_path / "other.json", "w"))
    with pytest.raises(SystemExit, match="differ in mixer, batches or initial weights"):
        parity_torch.main(["--mixer", "softmax", "--steps", "3", "--window", "2,3", "--out", str(merged_dir),
                           "--merge", str(tmp_path / "first.json"), str(tmp_path / "other.json")])


def test_the_dot_precisions_fla_pins_in_its_source_are_reset(monkeypatch):
    """TRITON_F32_DEFAULT does not reach a tl.dot that names its input_precision; the tool resets those constants
    (here in a stand-in module; fla itself is not installed on the CPU machine)."""
    import types

    class Const:  # stands in for triton.language.constexpr
        def __init__(self, value):
            self.value = value

    module = types.ModuleType("fake_fla_chunk")
    module.SOLVE_TRIL_DOT_PRECISION = Const("tf32")
    module.SAFE_GATE_DOT_PRECISION = Const("bf16x3")
    module.OTHER = Const("tf32")
    monkeypatch.setitem(sys.modules, "fake_fla_chunk", module)
    lines = parity_torch.force_fla_dot_precision("tf32x3", ("fake_fla_chunk", "no_such_module.chunk"), Const)
    assert lines == ["fake_fla_chunk.SAFE_GATE_DOT_PRECISION: bf16x3 -> tf32x3",
                     "fake_fla_chunk.SOLVE_TRIL_DOT_PRECISION: tf32 -> tf32x3"]
    assert module.SOLVE_TRIL_DOT_PRECISION.value == module.SAFE_GATE_DOT_PRECISION.value == "tf32x3"
    assert module.OTHER.value == "tf32"  # only the *_DOT_PRECISION constants
