"""Nothing lost, nothing silent: a run directory belongs to one run, checkpoints are verified, bad data and
bad folders are reported before the first step, metrics describe one run, errors are one line."""
import errno
import glob
import json
import os
import re
import signal
import struct
import subprocess
import sys
import time

import jax.numpy as jnp
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import train as train_cli
from mixerlab.training import data as data_lib
from mixerlab.training import run_loop
from mixerlab.training.checkpoint import MANIFEST, Checkpointer
from mixerlab.training.config import load_config
from mixerlab.training.loop import train
from mixerlab.training.run_dir import RunDirError

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _args(run_dir, *extra):
    return [f"train.output_dir={run_dir}", "train.eval_every=0", "optim.warmup_steps=1", *extra]


def _cfg(run_dir, *extra):
    return load_config("configs/tiny.yaml", _args(run_dir, *extra))


def _snapshot(run_dir):
    """Every file under run_dir with its size and modification time."""
    out = {}
    for root, _dirs, files in os.walk(run_dir):
        for f in files:
            st = os.stat(os.path.join(root, f))
            out[os.path.relpath(os.path.join(root, f), run_dir)] = (st.st_size, st.st_mtime_ns)
    return out


def _largest_file(directory):
    files = [p for p in glob.glob(os.path.join(directory, "**", "*"), recursive=True) if os.path.isfile(p)]
    return max(files, key=os.path.getsize)


def _rows(run_dir):
    return [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]


def _tensorboard_steps(run_dir, tag="train/loss"):
    """Steps of ``tag`` in the TensorBoard event files (TFRecord framing, Event protos)."""
    from tensorboardX.proto import event_pb2

    steps = []
    for path in glob.glob(os.path.join(run_dir, "tensorboard", "events.*")):
        with open(path, "rb") as f:
            while header := f.read(12):
                (length,) = struct.unpack("<Q", header[:8])
                event = event_pb2.Event.FromString(f.read(length))
                f.read(4)
                steps += [event.step for v in event.summary.value if v.tag == tag]
    return sorted(steps)


# ------------------------------------------------------------------------------------ run directory
def test_a_changed_model_or_data_config_is_refused_and_a_safe_change_resumes(tmp_path, capsys):
    run = tmp_path / "run"
    train(_cfg(run, "train.steps=6", "checkpoint.every=2"), stop_at_step=4, progress=False)
    before = _snapshot(run)
    config_before = (run / "config.yaml").read_text()
    refused = {
        "model.mixer=linear_attention": ["model.mixer", "'softmax' in the checkpoint", "'linear_attention' now"],
        "model.d_model=96": ["model.d_model", "64 in the checkpoint", "96 now", "model or optimizer state"],
        "optim.b2=0.99": ["optim.b2"],
        "train.batch_size=8": ["train.batch_size", "cannot be remapped"],
        "data.seq_len=32": ["data.seq_len", "cannot be remapped"],
    }
    for override, fragments in refused.items():
        with pytest.raises(RunDirError) as err:
            train(_cfg(run, "train.steps=6", "checkpoint.every=2", override), progress=False)
        for fragment in fragments + ["newest step 4", "train.resume=false", "train.output_dir"]:
            assert fragment in str(err.value), (fragment, str(err.value))
    # The command line: exit code 2, one line, nothing in the directory touched.
    code = train_cli.main(["--config", "configs/tiny.yaml", *_args(run, "train.steps=6", "checkpoint.every=2",
                                                                   "model.d_model=96")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("error: ") and "model.d_model" in err[0]
    assert _snapshot(run) == before and (run / "config.yaml").read_text() == config_before
    # A safe change is stated and the run continues from its checkpoint.
    resumed = train(_cfg(run, "train.steps=6", "checkpoint.every=3", "train.log_every=1"), progress=False)
    assert sorted(resumed.train_losses) == [5, 6]
    assert "resuming with a changed setting: checkpoint.every: 2 in the checkpoint, 3 now" in capsys.readouterr().out
    # Checkpoints without a stored config (an older format, config.yaml gone): a different model is still
    # refused, from the parameter names, and its checkpoints are not mistaken for corrupt ones.
    for meta_path in glob.glob(str(run / "checkpoints" / "*" / "meta" / "metadata")):
        with open(meta_path) as f:
            meta = json.load(f)
        meta.pop("config")
        with open(meta_path, "w") as f:
            json.dump(meta, f)
        os.remove(os.path.join(os.path.dirname(os.path.dirname(meta_path)), MANIFEST))  # none in that format
    os.remove(run / "config.yaml")
    before = _snapshot(run)
    with pytest.raises(RunDirError, match="holds the parameters of a different model .*blocks.2"):
        train(_cfg(run, "train.steps=6", "model.num_layers=4"), progress=False)
    after = _snapshot(run)
    after.pop("train.log"), before.pop("train.log")  # this check runs after the model is built: the log has it
    assert after == before and not (run / "checkpoints.quarantine").exists()


def test_unwritable_checkpoint_folder_is_reported_before_the_first_step(tmp_path):
    run = tmp_path / "ro"
    run.mkdir()
    if os.geteuid() == 0:  # root writes through permissions: point the folder at a read-only file system
        os.symlink("/sys/kernel", run / "checkpoints")
    else:
        (run / "checkpoints").mkdir()
        os.chmod(run / "checkpoints", 0o555)
    with pytest.raises(RunDirError, match=r"train.output_dir \(its checkpoints folder\): cannot write to"):
        train(_cfg(run, "train.steps=2", "checkpoint.every=2"), progress=False)
    assert not (run / "metrics.jsonl").exists()  # no step was computed


# ------------------------------------------------------------------------------------ checkpoints
def test_corrupt_checkpoints_are_quarantined_and_training_continues_identically(tmp_path, capfd):
    common = ("train.steps=8", "checkpoint.every=2", "checkpoint.keep=3", "train.log_every=1")
    full = train(_cfg(tmp_path / "full", *common), progress=False)
    ckpt = full.checkpoint_dir
    assert sorted(os.listdir(ckpt)) == ["4", "6", "8"]
    # Step 8: three flipped bytes in the parameter data (its manifest catches them).
    # (the array data: such flips load without any error from orbax, as values up to 3e38 and NaNs)
    with open(_largest_file(os.path.join(ckpt, "8", "params")), "r+b") as f:
        for offset in (1000, 2000, 3000):
            f.seek(offset)
            byte = f.read(1)
            f.seek(offset)
            f.write(bytes([byte[0] ^ 0xFF]))
    # Step 6: truncated and without a manifest (as if killed between the save and the manifest).
    if os.path.exists(os.path.join(ckpt, "6", MANIFEST)):
        os.remove(os.path.join(ckpt, "6", MANIFEST))
    data_file = _largest_file(os.path.join(ckpt, "6", "params"))
    with open(data_file, "r+b") as f:
        f.truncate(os.path.getsize(data_file) // 2)
    capfd.readouterr()

    resumed = train(_cfg(tmp_path / "full", *common), progress=False)
    out = capfd.readouterr()
    # Training after the fallback equals the uninterrupted run, loss for loss.
    assert sorted(resumed.train_losses) == [5, 6, 7, 8]
    for step in range(5, 9):
        assert resumed.train_losses[step] == full.train_losses[step], step
    # Each bad step: one line naming it and where it went; no library dump.
    lines = (out.out + out.err).splitlines()
    assert len([l for l in lines if "checkpoint step 8" in l]) == 1
    assert len([l for l in lines if "checkpoint step 6" in l]) == 1
    assert any("checkpoint step 8" in l and "does not match its checksum" in l for l in lines)
    assert len(lines) < 10, lines
    quarantine = ckpt + ".quarantine"
    assert sorted(n for n in os.listdir(quarantine) if n.isdigit()) == ["6", "8"]
    # Saving continued at the quarantined steps; keep counts only good steps.
    checker = Checkpointer(ckpt, keep=3, async_save=False)
    try:
        assert checker.steps() == [4, 6, 8]
        assert all(checker.verify(s) is None and checker.has_manifest(s) for s in (6, 8))
    finally:
        checker.close()
    assert [r["step"] for r in _rows(full.run_dir)] == list(range(1, 9))


def test_non_finite_parameters_are_never_saved_and_a_flipped_byte_is_detected(tmp_path):
    checker = Checkpointer(str(tmp_path / "ckpt"), keep=3, async_save=False)
    try:
        good = {"w": jnp.arange(256, dtype=jnp.float32)}
        assert not checker.save(1, params={"w": good["w"].at[3].set(jnp.nan)}, opt_state={"m": good["w"]},
                                data_state={}, meta={})
        assert checker.steps() == []
        assert checker.save(2, params=good, opt_state={"m": good["w"]}, data_state={}, meta={})
        assert checker.has_manifest(2) and checker.verify(2) is None
        with open(_largest_file(str(tmp_path / "ckpt" / "2" / "params")), "r+b") as f:
            f.seek(40)
            byte = f.read(1)
            f.seek(40)
            f.write(bytes([byte[0] ^ 0x01]))
        assert "does not match its checksum" in checker.verify(2)
    finally:
        checker.close()
    # Asynchronous saves get their manifest once complete: when the next save starts, or at close().
    checker = Checkpointer(str(tmp_path / "async"), keep=3, async_save=True)
    try:
        for step in (1, 2):
            assert checker.save(step, params=good, opt_state={"m": good["w"]}, data_state={}, meta={})
        assert checker.has_manifest(1) and checker.verify(1) is None
    finally:
        checker.close()
    assert os.path.exists(tmp_path / "async" / "2" / MANIFEST)


def test_sigterm_message_is_true_and_rows_of_an_attempt_without_a_checkpoint_are_dropped(tmp_path, monkeypatch, capsys):
    real = run_loop.data_lib.train_iterator

    class _TermAtStep2:
        def __init__(self, inner):
            self.inner, self.n = inner, 0

        def __next__(self):
            self.n += 1
            if self.n == 2:
                os.kill(os.getpid(), signal.SIGTERM)
            return next(self.inner)

        def get_state(self):
            return self.inner.get_state()

        def set_state(self, state):
            self.inner.set_state(state)

    run = tmp_path / "term"
    # prefetch=0: the data iterator raises SIGTERM when batch 2 is drawn, which must be during step 2 (a
    # prefetch thread would draw it during step 1). train.steps=6 as in the other runs of this file: the
    # schedule, and so the compiled step, is the same (the session's compile cache serves it).
    common = ("train.steps=6", "train.log_every=1", "train.prefetch=0")
    with monkeypatch.context() as patch:
        patch.setattr(run_loop.data_lib, "train_iterator", lambda *a, **k: _TermAtStep2(real(*a, **k)))
        patch.setattr(run_loop.Checkpointer, "save", lambda self, step, **kw: False)  # e.g. non-finite parameters
        result = train(_cfg(run, *common), progress=False)
    out = capsys.readouterr().out
    assert result.preempted and result.final_step == 2
    assert "saved a checkpoint" not in out
    assert "SIGTERM: stopped after step 2 without a checkpoint of it; the same command resumes from step 0" in out
    # The rows of that attempt (steps 1, 2; no checkpoint) are dropped when the run starts again, in
    # metrics.jsonl and in TensorBoard.
    assert [r["step"] for r in _rows(run)] == [1, 2]
    train(_cfg(run, *common), progress=False)
    assert [r["step"] for r in _rows(run)] == [1, 2, 3, 4, 5, 6]
    assert _tensorboard_steps(run) == [1, 2, 3, 4, 5, 6]


# ------------------------------------------------------------------------------------ data
def _parquet(path, column):
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"text": column}), path)
    return str(path)


def _cli_error(capsys, run_dir, *overrides):
    """(exit code, stderr lines other than the progress bar) of train.py on the tiny config."""
    code = train_cli.main(["--config", "configs/tiny.yaml", *_args(run_dir, "train.steps=2", *overrides)])
    return code, [l for l in capsys.readouterr().err.strip().splitlines() if not l.startswith("train:")]


@pytest.mark.parametrize("column, fragments", [
    (pa.array(["", " ", None] * 4), ["every document", "empty or null"]),
    (pa.array([b"Type Objects\n"] * 12, pa.binary()), ["has type binary", "not string"]),
    (pa.array(list(range(12)), pa.int64()), ["has type int64"]),
    (pa.array([b"ok", b"\xff\xfebad"] * 6, pa.binary()).view(pa.string()), ["not valid UTF-8", "row group 0"]),
])
def test_bad_text_columns_stop_the_run_before_the_first_step(tmp_path, capsys, column, fragments):
    path = _parquet(tmp_path / "bad" / "part-0.parquet", column)
    code, err = _cli_error(capsys, tmp_path / "run", f"data.train_path={tmp_path / 'bad'}")
    assert code == 2 and len(err) == 1, err
    for fragment in fragments + ["error: data.train_path", path, "column 'text'"]:
        assert fragment in err[0], (fragment, err[0])
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_many_empty_documents_are_a_warning(tmp_path):
    some = _parquet(tmp_path / "some.parquet", pa.array(["text"] * 8 + [""] * 3 + [None]))
    (warning,) = data_lib.check_text_data(some, "data.train_path")
    assert "4 of 12 documents" in warning and "33%" in warning and "column 'text'" in warning
    assert data_lib.check_text_data("data/embedded/train", "data.train_path") == []


# ------------------------------------------------------------------------------------ errors
def test_disk_full_is_one_line_with_details_in_the_log(tmp_path, monkeypatch, capsys):
    import orbax.checkpoint as ocp

    def full(self, *a, **k):
        import logging

        logging.getLogger("absl").error("orbax write failed\n" + "  tensorstore spec ...\n" * 60)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ocp.CheckpointManager, "save", full)
    run = tmp_path / "full"  # train.steps=6: the compiled step of the other runs here (the first save fails)
    code = train_cli.main(["--config", "configs/tiny.yaml", *_args(run, "train.steps=6", "checkpoint.every=2")])
    err = [l for l in capsys.readouterr().err.strip().splitlines() if not l.startswith("train:")]  # progress bar
    assert code == 1 and len(err) == 1, err
    assert "checkpoint step 2: no space left on the device of" in err[0] and "train.log" in err[0]
    log_text = (run / "train.log").read_text()
    assert "Traceback" in log_text and "orbax write failed" in log_text  # the library's dump went to the log


# ------------------------------------------------------------------------------------ processes
@pytest.mark.slow
def test_sigkill_ends_the_grain_workers_too(tmp_path):
    import psutil

    run = tmp_path / "workers"
    cmd = [sys.executable, "train.py", "--config", "configs/tiny.yaml", *_args(run, "train.steps=500",
           "train.log_every=1", "checkpoint.every=0", "data.num_workers=1")]
    proc = subprocess.Popen(cmd, cwd=REPO, env={**os.environ, "JAX_PLATFORMS": "cpu"}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 240
        while time.time() < deadline and proc.poll() is None and not (run / "metrics.jsonl").exists():
            time.sleep(0.2)
        assert proc.poll() is None, "training ended before it could be killed"
        children = psutil.Process(proc.pid).children(recursive=True)
        assert children, "no grain worker process found"
    finally:
        proc.kill()
        proc.wait()
    _gone, alive = psutil.wait_procs(children, timeout=10)
    for p in alive:
        p.kill()
    assert not alive, f"worker processes outlived the trainer: {[p.pid for p in alive]}"


# ------------------------------------------------------------------------------------ checkpoint faults
def _small_state(value=1.0):
    params = {"w": jnp.full((16, 8), value, jnp.float32), "b": jnp.zeros((8,), jnp.float32)}
    opt = {"m": jnp.zeros((16, 8), jnp.float32), "count": jnp.zeros((), jnp.int32)}
    return params, opt


def test_an_async_save_gets_its_manifest_when_it_completes_not_at_the_next_save(tmp_path):
    """A kill after an async save completes but before the next save must not leave the newest step unchecked."""
    checker = Checkpointer(str(tmp_path / "async"), keep=3, async_save=True)
    try:
        params, opt = _small_state()
        assert checker.save(1, params=params, opt_state=opt, data_state={}, meta={})
        deadline = time.time() + 30
        while time.time() < deadline and not os.path.exists(tmp_path / "async" / "1" / MANIFEST):
            time.sleep(0.05)
        assert os.path.exists(tmp_path / "async" / "1" / MANIFEST), "no manifest until the next save"
        assert checker.verify(1) is None
    finally:
        checker.close()


def test_an_async_save_that_fails_in_the_background_is_reported_at_the_next_save(tmp_path, monkeypatch):
    checker = Checkpointer(str(tmp_path / "async"), keep=3, async_save=True)
    params, opt = _small_state()

    def fail(step):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(checker, "_write_manifest", fail)
    assert checker.save(1, params=params, opt_state=opt, data_state={}, meta={})
    with pytest.raises(Exception, match="Input/output error"):
        checker.save(2, params=params, opt_state=opt, data_state={}, meta={})
    monkeypatch.undo()
    checker.close()


@pytest.mark.parametrize("damage, problem", [
    ("huge_param", "parameters hold a value of magnitude"),
    ("nan_moment", "optimizer state holds non-finite values"),
])
def test_a_step_without_manifest_is_checked_by_its_values_and_quarantined(tmp_path, damage, problem):
    """A step killed between its save and its manifest, with damage orbax reads back without complaint (a
    flipped exponent bit: 1e30; a NaN moment): quarantined, and the previous step is restored."""
    directory = str(tmp_path / "ckpt")
    checker = Checkpointer(directory, keep=3, async_save=False)
    try:
        params, opt = _small_state(1.0)
        assert checker.save(1, params=params, opt_state=opt, data_state={"s": 1}, meta={})
        if damage == "huge_param":
            params = {**params, "w": params["w"].at[3, 2].set(3e30)}
        else:
            opt = {**opt, "m": opt["m"].at[0, 0].set(jnp.nan)}
        assert checker.save(2, params=params, opt_state=opt, data_state={"s": 2}, meta={})
    finally:
        checker.close()
    os.remove(os.path.join(directory, "2", MANIFEST))
    fresh = Checkpointer(directory, keep=3, async_save=False)
    messages = []
    try:
        template = _small_state(0.0)
        step, restored, _opt, data, _meta = fresh.restore_newest(params=template[0], opt_state=template[1],
                                                                 report=messages.append)
    finally:
        fresh.close()
    assert step == 1 and data == {"s": 1} and float(restored["w"][3, 2]) == 1.0
    assert len(messages) == 1 and "checkpoint step 2" in messages[0] and problem in messages[0], messages
    assert os.listdir(directory + ".quarantine") == ["2", "2.reason.txt"] or \
        sorted(os.listdir(directory + ".quarantine")) == ["2", "2.reason.txt"]


def test_a_step_without_manifest_and_plausible_values_is_still_restored(tmp_path):
    directory = str(tmp_path / "ckpt")
    checker = Checkpointer(directory, keep=3, async_save=False)
    params, opt = _small_state(2.0)
    assert checker.save(3, params=params, opt_state=opt, data_state={}, meta={})
    checker.close()
    os.remove(os.path.join(directory, "3", MANIFEST))
    fresh = Checkpointer(directory, keep=3, async_save=False)
    try:
        template = _small_state(0.0)
        assert fresh.restore_newest(params=template[0], opt_state=template[1], report=print)[0] == 3
    finally:
        fresh.close()


def _disk_that_holds(monkeypatch, n_steps):
    """Saves fail with ENOSPC while ``n_steps`` steps are on disk; the free space reported is below one step."""
    import orbax.checkpoint as ocp

    from mixerlab.training import checkpoint as checkpoint_lib

    real_save = ocp.CheckpointManager.save

    def save(self, step, *a, **k):
        if len([s for s in os.listdir(self.directory) if s.isdigit()]) >= n_steps:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(self, step, *a, **k)

    monkeypatch.setattr(ocp.CheckpointManager, "save", save)
    monkeypatch.setattr(checkpoint_lib.shutil, "disk_usage", lambda path: shutil_usage(free=1024))


def shutil_usage(free):
    import collections

    return collections.namedtuple("usage", "total used free")(10 * 2**30, 10 * 2**30 - free, free)


def test_a_full_disk_that_holds_keep_steps_prunes_before_saving(tmp_path, monkeypatch):
    """orbax deletes the oldest step only after a save; a disk with room for exactly checkpoint.keep steps never
    lets that save finish. The oldest step (which the save would have deleted) goes first instead."""
    _disk_that_holds(monkeypatch, 2)
    checker = Checkpointer(str(tmp_path / "ckpt"), keep=2, async_save=False)
    try:
        params, opt = _small_state()
        for step in (1, 2, 3, 4):
            assert checker.save(step, params=params, opt_state=opt, data_state={}, meta={})
        assert checker.steps() == [3, 4]
    finally:
        checker.close()


def test_a_full_disk_names_the_folders_that_can_be_deleted(tmp_path, monkeypatch):
    from mixerlab.training.checkpoint import CheckpointError

    directory = str(tmp_path / "ckpt")
    checker = Checkpointer(directory, keep=4, async_save=False)
    params, opt = _small_state()
    for step in (2, 4, 6):
        assert checker.save(step, params=params, opt_state=opt, data_state={}, meta={})
    _disk_that_holds(monkeypatch, 3)
    with pytest.raises(CheckpointError) as info:
        checker.save(8, params=params, opt_state=opt, data_state={}, meta={})
    message = str(info.value)
    assert "\n" not in message and "checkpoint step 8: no space left on the device of" in message
    assert f"{directory}/2, {directory}/4" in message and f"the newest, {directory}/6, is the one resumed from" \
        in message and "resume from step 6" in message
    assert "keep lower" not in message  # pruning happens after a save: that advice frees nothing
    checker.close()


@pytest.mark.slow
def test_disk_full_is_the_same_line_again_when_the_log_cannot_be_written_either(tmp_path, monkeypatch, capsys):
    """The second run on a full disk: its train.log cannot be written either. Still one line, the same one, and
    no "--- Logging error ---" dumps."""
    import io
    import logging

    import orbax.checkpoint as ocp

    def full(self, *a, **k):
        logging.getLogger("absl").error("orbax write failed\n" + "  tensorstore spec ...\n" * 60)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ocp.CheckpointManager, "save", full)
    run = tmp_path / "full"
    args = ["--config", "configs/tiny.yaml", *_args(run, "train.steps=6", "checkpoint.every=2")]
    errors = []
    for attempt in range(2):
        if attempt == 1:
            class FullFile(io.StringIO):
                def write(self, s):
                    raise OSError(errno.ENOSPC, "No space left on device")

                def flush(self):
                    raise OSError(errno.ENOSPC, "No space left on device")

            monkeypatch.setattr(logging.FileHandler, "_open", lambda self: FullFile())
        code = train_cli.main(args)
        err = [re.sub(r"^train: .*?(?=warning: |$)", "", l) for l in capsys.readouterr().err.strip().splitlines()]
        err = [l for l in err if l.strip()]  # the progress bar's lines (the bar and a message may share one)
        if attempt == 1:  # the log file's failure is said once, not once per record with a traceback each
            assert err[0].startswith("warning: cannot write the log file") and "No space left" in err[0], err
            err = err[1:]
        assert code == 1 and len(err) == 1, err
        errors.append(re.sub(r"\d+ MiB free", "N MiB free", err[0].split(" (details:")[0]))
    assert errors[0] == errors[1] and errors[0].startswith("error: checkpoint step 2: no space left"), errors
