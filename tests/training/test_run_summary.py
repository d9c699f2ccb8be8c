"""How a run ends on the command line: train.log holds what the run printed, a diverged run says so and exits
non-zero, and rerunning a finished run prints its numbers instead of ``final train loss nan``."""
import json
import math
import os

import pytest

from mixerlab.training import cli
from mixerlab.training.run_summary import DIVERGED_FACTOR, divergence, divergence_lines

V = 8192  # the embedded tokenizer's vocabulary: ln V = 9.01


def _main(run, *extra):
    return cli.main(["--config", "configs/tiny.yaml", f"train.output_dir={run}", "model.num_layers=1",
                     "optim.warmup_steps=1", *extra])


def test_train_log_holds_what_the_run_prints(tmp_path, capsys):
    run = tmp_path / "run"
    assert _main(run, "train.steps=4", "train.log_every=2", "train.eval_every=2", "checkpoint.every=2") == 0
    printed = [line for line in capsys.readouterr().out.splitlines() if line.strip()]
    log = (run / "train.log").read_text()
    assert any(line.startswith("mixerlab: softmax model") for line in printed)
    for line in printed:  # the header, the evaluations and the final summary
        assert line in log, f"{line!r} not in train.log"
    assert "step 2: validation loss" in log and "done in" in log
    assert "step 2: loss " in log and "step 4: loss " in log  # the progress rows (the terminal has a bar)


def test_rerunning_a_finished_run_prints_its_final_numbers(tmp_path, capsys):
    run = tmp_path / "run"
    args = ("train.steps=2", "train.eval_every=2", "checkpoint.every=2")
    assert _main(run, *args) == 0
    rows = [json.loads(line) for line in open(run / "metrics.jsonl")]
    train_loss = [r["loss"] for r in rows if r["split"] == "train"][-1]
    val_loss = [r["loss"] for r in rows if r["split"] == "val"][-1]
    capsys.readouterr()
    assert _main(run, *args) == 0
    out = capsys.readouterr().out
    assert "nan" not in out
    assert "already complete: the run reached train.steps=2" in out
    assert f"final train loss {train_loss:.4f} (step 2)" in out and f"validation loss {val_loss:.4f} (step 2)" in out
    assert "raise train.steps" in out
    assert "already complete" in (run / "train.log").read_text()


def test_a_diverged_run_says_so_and_exits_nonzero(tmp_path, capsys):
    run = tmp_path / "run"
    code = _main(run, "optim.lr=10", "train.steps=8", "train.log_every=1", "train.eval_every=0", "checkpoint.every=4")
    out = capsys.readouterr().out
    assert code == 1, out
    assert "\ndiverged in " in out and "DIVERGED: the recent train loss" in out
    assert f"above {DIVERGED_FACTOR} x ln(vocab) = {DIVERGED_FACTOR * math.log(V):.2f}" in out
    assert "checkpoints of steps 4, 8 in" in out and "lower optim.lr (now 10)" in out
    assert "DIVERGED" in (run / "train.log").read_text()


def test_divergence_is_the_recent_median_against_ln_vocab():
    limit = DIVERGED_FACTOR * math.log(V)
    healthy = {s: 9.0 - 0.1 * s for s in range(1, 30)}
    assert divergence(healthy, V) is None
    spike = {**healthy, 25: 500.0}  # one spike near the end: the median ignores it
    assert divergence(spike, V) is None
    climbed = {1: 9.0, 2: 9.0, 3: 58.0, **{s: 300.0 for s in range(4, 20)}}
    d = divergence(climbed, V)
    assert d is not None and d.first_step == 3 and d.recent_loss == 300.0 and d.limit == pytest.approx(limit)
    nans = {1: 9.0, 2: 9.0, **{s: math.nan for s in range(3, 12)}}
    d = divergence(nans, V)
    assert d is not None and d.first_step == 3 and math.isinf(d.recent_loss)
    assert divergence({}, V) is None and divergence(healthy, None) is None


def test_divergence_lines_name_the_checkpoints_before_and_after(tmp_path):
    for step in (2, 4, 6, "4.orbax-checkpoint-tmp"):
        os.makedirs(tmp_path / str(step))
    d = divergence({1: 9.0, 2: 9.0, 3: 9.0, 4: 50.0, 5: 60.0, 6: 70.0}, V)
    text = "\n".join(divergence_lines(d, str(tmp_path), 0.5))
    assert "checkpoints of steps 4, 6" in text and "newest from before the divergence is step 2" in text
    assert "lower optim.lr (now 0.5)" in text
