"""Resuming a run directory with changed settings: what may change (optim.lr after a divergence, train.steps)
is recorded in train.log and metrics.jsonl, from what to what; a refused change lists the user's changes first."""
import json
import os

import pytest

from mixerlab.training import run_dir as run_dir_lib
from mixerlab.training.config import load_config
from mixerlab.training.loop import train
from mixerlab.training.optim import schedule
from mixerlab.training.run_dir import RunDirError, compare_with_checkpoint


def _cfg(run, *extra):
    return load_config("configs/tiny.yaml", [f"train.output_dir={run}", "train.eval_every=0", "optim.warmup_steps=1",
                                             "model.num_layers=1", *extra])


def _fake_checkpoint(run, cfg, step=4):
    """A run directory whose newest checkpoint stores ``cfg`` (the metadata is all the comparison reads)."""
    meta = run / "checkpoints" / str(step) / "meta"
    meta.mkdir(parents=True)
    (meta / "metadata").write_text(json.dumps({"step": step, "config": cfg.to_dict()}))


def test_a_lower_lr_and_more_steps_resume_and_the_change_is_recorded(tmp_path, capsys):
    run = tmp_path / "run"
    train(_cfg(run, "train.steps=4", "checkpoint.every=2"), stop_at_step=2, progress=False)
    cfg = _cfg(run, "train.steps=6", "checkpoint.every=2", "optim.lr=1e-3", "train.log_every=1")
    resumed = train(cfg, progress=False)
    assert sorted(resumed.train_losses) == [3, 4, 5, 6]
    out = capsys.readouterr().out
    note = "resuming with a changed setting: optim.lr: 0.003 in the checkpoint, 0.001 now"
    assert note in out and note in (run / "train.log").read_text()
    rows = [json.loads(line) for line in open(run / "metrics.jsonl")]
    events = [r for r in rows if r["split"] == "config_change"]
    assert events == [{"step": 2, "split": "config_change",
                       "changed": {"optim.lr": {"from": 0.003, "to": 0.001}, "train.log_every": {"from": 5, "to": 1},
                                   "train.steps": {"from": 4, "to": 6}}}]
    # the new peak rate is the one used from the resumed step on
    lr = {r["step"]: r["lr"] for r in rows if r["split"] == "train"}
    assert lr[3] == pytest.approx(float(schedule(cfg)(2)), rel=1e-6) and lr[3] < 1e-3 + 1e-9


@pytest.mark.parametrize("override", ["optim.lr=1e-4", "optim.min_lr_ratio=0.01", "optim.warmup_steps=2",
                                      "optim.weight_decay=0.0", "train.steps=40"])
def test_schedule_keys_may_change_on_resume(tmp_path, override):
    run = tmp_path / "run"
    _fake_checkpoint(run, _cfg(run))
    notes = compare_with_checkpoint(_cfg(run, override), str(run))
    assert len(notes) == 1 and notes[0].startswith(override.split("=")[0] + ": "), notes


@pytest.mark.parametrize("override", ["optim.b1=0.8", "optim.b2=0.99", "optim.eps=1e-6", "optim.grad_clip=null",
                                      "optim.ssm_lr_cap=1e-3"])
def test_optimizer_state_keys_are_still_refused(tmp_path, override):
    run = tmp_path / "run"
    _fake_checkpoint(run, _cfg(run))
    with pytest.raises(RunDirError, match=override.split("=")[0]):
        compare_with_checkpoint(_cfg(run, override), str(run))


def test_a_mixer_swap_lists_the_changed_keys_first_and_suggests_a_new_output_dir(tmp_path):
    run = tmp_path / "run"
    muir = load_config("configs/lm_compare/muir.yaml", [f"train.output_dir={run}"])
    _fake_checkpoint(run, muir)
    gdn2 = load_config("configs/lm_compare/gdn2.yaml", [f"train.output_dir={run}"])
    with pytest.raises(RunDirError) as err:
        compare_with_checkpoint(gdn2, str(run))
    msg = str(err.value)
    listed = msg.split("different config: ", 1)[1]
    # the user's changes (values on both sides) come first, the mixer first of all; the old mixer's options
    # (in the checkpoint only) are one group after them
    assert listed.startswith("model.mixer: 'muir' in the checkpoint, 'gdn2' now; model.ffn_dim: 1536 in the "
                             "checkpoint, 1280 now; mixers.muir.* ("), listed
    assert "keys: allow_neg_eigval, chunk_size" in listed and "in the checkpoint, not set now" in listed
    assert f"train.output_dir={run}-gdn2" in msg
    (tmp_path / "run-gdn2").mkdir()  # taken: the next free name
    with pytest.raises(RunDirError, match=f"train.output_dir={run}-gdn2-2"):
        compare_with_checkpoint(gdn2, str(run))


def test_changed_settings_without_a_checkpoint_is_empty(tmp_path):
    assert run_dir_lib.changed_settings(_cfg(tmp_path), str(tmp_path)) == {}
    assert not os.listdir(tmp_path)
