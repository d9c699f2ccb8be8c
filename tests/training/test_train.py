"""End-to-end training on the embedded sample: loss decreases, interrupt + resume is bitwise identical,
the mixer swaps with one override, and the run writes its outputs."""
import json
import math
import os

import jax
import pytest

from mixerlab import mixers

from mixerlab.training.config import load_config
from mixerlab.training.loop import train



def _cfg(tmp_path, name, *extra):
    return load_config("configs/tiny.yaml", [f"train.output_dir={tmp_path / name}", *extra])


def _trainer_and_batch(tmp_path, name, batch_size, *extra):
    """An initialised Trainer of the tiny config with one block (the equalities below hold per block; the compile
    is the time) and its first global batch of ``batch_size`` rows."""
    from mixerlab.training import data as data_lib
    from mixerlab.training.loop import Trainer
    from mixerlab.training.tokenizer import load_tokenizer

    cfg = _cfg(tmp_path, name, f"train.batch_size={batch_size}", "model.num_layers=1", *extra)
    tok = load_tokenizer(cfg.data.tokenizer.kind, cfg.data.tokenizer.path)
    trainer = Trainer(cfg, tok.vocab_size)
    trainer.initialize()
    batch = trainer.global_batch(next(data_lib.train_iterator(cfg.data, tok, global_batch_size=batch_size, seed=0)))
    return trainer, batch


def test_tiny_run_writes_outputs_and_validates(tmp_path):
    # one block: the same train-step program as the softmax case of the every-mixer test (compiled once)
    cfg = _cfg(tmp_path, "outputs", "model.num_layers=1", "train.steps=30", "train.eval_every=15",
               "train.log_every=1")
    result = train(cfg, progress=False)
    losses = [result.train_losses[s] for s in sorted(result.train_losses)]
    assert len(losses) == 30
    assert result.val_loss is not None and result.val_loss < losses[0]
    rows = [json.loads(line) for line in open(result.metrics_path)]
    assert {r["split"] for r in rows} == {"train", "val"}
    # the lr the run logs: row of step s = the lr of its update, schedule(s − 1): linear warmup over
    # optim.warmup_steps (tiny: 5), the peak at update warmup_steps + 1, then the cosine that would reach
    # lr·min_lr_ratio at train.steps (the next step after the last), falling monotonically
    logged = {r["step"]: r["lr"] for r in rows if r["split"] == "train"}
    assert sorted(logged) == list(range(1, 31))
    o, w = cfg.optim, cfg.optim.warmup_steps
    floor = o.lr * o.min_lr_ratio
    for step, value in logged.items():
        i = step - 1
        want = o.lr * i / w if i < w else floor + (o.lr - floor) * 0.5 * (1 + math.cos(math.pi * (i - w) / (30 - w)))
        assert value == pytest.approx(want, rel=1e-5, abs=1e-12), (step, value, want)
    assert logged[w + 1] == pytest.approx(o.lr, rel=1e-6) and logged[30] > floor
    assert all(logged[s + 1] <= logged[s] for s in range(w + 1, 30))
    assert [r["step"] for r in rows if r["split"] == "val"] == [15, 30]
    assert os.path.exists(result.plot_path)
    assert os.listdir(os.path.join(result.run_dir, "tensorboard"))
    assert os.path.exists(os.path.join(result.run_dir, "config.yaml"))


# make test (Muir = GDN-2 + γ); the rest: test-all (VLA runs train steps in the MQAR CLI tests and S4D in the
# hybrid-model test of make test)
FAMILY_MIXERS = ("softmax", "muir", "interdomain")


@pytest.mark.parametrize("mixer", [m if m in FAMILY_MIXERS else pytest.param(m, marks=pytest.mark.extended)
                                   for m in mixers.registry.names()])
def test_every_mixer_trains_with_decreasing_loss(tmp_path, mixer):
    """`model.mixer=<name>` is the only change needed to train any registered mixer.

    One block: the mixer sits between the embedding and the loss either way, and the compile (most of the
    time) grows with the number of blocks; the loss still falls by about 2 in 30 steps (Muir: 9.01 -> 7.03)."""
    cfg = _cfg(tmp_path, mixer, f"model.mixer={mixer}", "model.num_layers=1", "train.steps=30",
               "train.eval_every=0", "checkpoint.every=0")
    result = train(cfg, progress=False)
    losses = [result.train_losses[s] for s in sorted(result.train_losses)]
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < first - 0.5, f"{mixer}: loss did not decrease enough ({first:.3f} -> {last:.3f})"


def test_interrupted_and_resumed_run_matches_uninterrupted_bitwise(tmp_path):
    common = ("train.steps=12", "checkpoint.every=4", "train.eval_every=0")
    full = train(_cfg(tmp_path, "full", *common), progress=False)
    # Interrupted after step 6: the newest checkpoint is step 4, so steps 5..12 run again on resume.
    part = train(_cfg(tmp_path, "resumed", *common), stop_at_step=6, progress=False)
    assert part.final_step == 6
    resumed = train(_cfg(tmp_path, "resumed", *common), progress=False)
    assert sorted(resumed.train_losses) == list(range(5, 13))
    # Bitwise on CPU; GPU reductions (atomics) are not deterministic, so there only to float32 rounding.
    same = (lambda a, b: a == b) if jax.default_backend() == "cpu" else (lambda a, b: abs(a - b) <= 1e-5 * abs(b))
    for step in range(5, 13):
        assert same(resumed.train_losses[step], full.train_losses[step]), f"step {step} differs after resume"
    for step in range(1, 7):
        assert same(part.train_losses[step], full.train_losses[step])
    steps_logged = [json.loads(line)["step"] for line in open(resumed.metrics_path)]
    assert steps_logged == sorted(steps_logged) and len(steps_logged) == len(set(steps_logged))


@pytest.mark.extended  # the resume tests in make test exercise the same checkpoint lookup
def test_resume_false_starts_fresh(tmp_path):
    common = ("train.steps=6", "checkpoint.every=2", "train.eval_every=0")
    train(_cfg(tmp_path, "fresh", *common), progress=False)
    again = train(_cfg(tmp_path, "fresh", *common, "train.resume=false"), progress=False)
    assert sorted(again.train_losses) == [1, 2, 3, 4, 5, 6]


def test_profile_captures_a_trace_and_the_summary_tool_reads_it(tmp_path, capsys):
    import importlib.util

    cfg = _cfg(tmp_path, "prof", "model.num_layers=1", "train.steps=8", "train.eval_every=0", "checkpoint.every=0",
               "profile.start_step=6", "profile.num_steps=2")
    result = train(cfg, progress=False)
    spec = importlib.util.spec_from_file_location("summarize_profile", "tools/summarize_profile.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    assert tool.main([os.path.join(result.run_dir, "profile"), "--top", "5"]) == 0
    out = capsys.readouterr().out
    assert "non-Python events" in out and "matmul" in out


def test_loss_chunk_gives_the_same_loss_and_gradients(tmp_path):
    # train.loss_chunk slices the output layer + loss over T and recomputes each slice in the backward pass;
    # loss and every gradient must equal the whole-sequence computation (float32 rounding only).
    import numpy as np

    results = []
    for chunk in (0, 16):
        trainer, batch = _trainer_and_batch(tmp_path, f"chunk{chunk}", 4, f"train.loss_chunk={chunk}")
        (loss, count), grads = jax.jit(trainer._loss_and_grads)(trainer.params, batch)
        results.append((float(loss), float(count), jax.tree.leaves(grads)))
    (l0, c0, g0), (l1, c1, g1) = results
    assert c0 == c1 > 0 and abs(l0 - l1) <= 1e-6 * abs(l0), (l0, l1)
    scale = max(float(np.max(np.abs(np.asarray(a)))) for a in g0)
    assert max(float(np.max(np.abs(np.asarray(a) - np.asarray(b)))) for a, b in zip(g0, g1)) <= 1e-5 * scale


def test_loss_chunk_must_divide_the_sequence(tmp_path):
    import pytest as _pytest

    with _pytest.raises(ValueError, match=r"train.loss_chunk: got 7; must be 0 \(off\) or divide data.seq_len"):
        _cfg(tmp_path, "bad", "train.loss_chunk=7")


def test_microbatches_give_the_same_step_as_one_batch(tmp_path):
    import numpy as np

    results = []
    for n in (1, 4):
        trainer, batch = _trainer_and_batch(tmp_path, f"micro{n}", 8, f"train.microbatches={n}")
        params, _, m = trainer.train_step(trainer.params, trainer.opt_state, batch)
        results.append((float(m["loss"]), float(m["grad_norm"]), jax.tree.leaves(params)))
    (l1, g1, p1), (l4, g4, p4) = results
    assert abs(l1 - l4) <= 1e-6 * abs(l1) and abs(g1 - g4) <= 1e-5 * abs(g1)
    assert max(float(np.max(np.abs(np.asarray(a) - np.asarray(b)))) for a, b in zip(p1, p4)) < 1e-6
