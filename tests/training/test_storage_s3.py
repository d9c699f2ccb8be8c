"""Training against a real S3-compatible server (moto, bound to 127.0.0.1; no internet): the data, the
tokenizer and the run directory all live in a bucket; a SIGTERM mid-run saves a checkpoint there and the
same command resumes from it with the same losses as a run that was never interrupted."""
import importlib.util
import json
import os
import signal

import numpy as np
import pytest

from mixerlab.training import run_loop
from mixerlab.training.config import load_config
from mixerlab.training.loop import train



def _missing(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is None
    except (ImportError, ValueError):
        return True


MISSING = [m for m in ("moto", "s3fs", "boto3") if _missing(m)]
pytestmark = pytest.mark.skipif(bool(MISSING), reason=f"needs {', '.join(MISSING)} (test extra: moto[server]; "
                                                      f"runtime extra mixerlab[cloud]: s3fs)")

BUCKET = "mixerlab-test"
EMBEDDED = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "data",
                        "embedded")


@pytest.fixture
def s3(monkeypatch, tmp_path):
    """A moto S3 server on 127.0.0.1 with the embedded corpus and tokenizer uploaded; yields the s3fs filesystem."""
    boto3 = pytest.importorskip("boto3", reason="the S3 tests need mixerlab[cloud] and moto (mixerlab[dev])")
    s3fs = pytest.importorskip("s3fs", reason="s3fs is not installed (runtime extra mixerlab[cloud])")
    pytest.importorskip("moto", reason="moto is not installed (mixerlab[dev])")
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    for key, value in {"AWS_ENDPOINT_URL": f"http://{host}:{port}", "AWS_ACCESS_KEY_ID": "testing",
                       "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(key, value)
    for key in ("AWS_PROFILE", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("MIXERLAB_STORAGE_CACHE", str(tmp_path / "storage-cache"))  # downloaded tokenizers
    for key in ("NO_PROXY", "no_proxy"):  # a proxy set for the machine must not intercept the local server
        monkeypatch.setenv(key, "127.0.0.1,localhost")
    s3fs.S3FileSystem.clear_instance_cache()  # an instance made before the endpoint was set would be reused
    boto3.client("s3").create_bucket(Bucket=BUCKET)
    fs = s3fs.S3FileSystem()
    fs.put_file(os.path.join(EMBEDDED, "train", "part-00000.parquet"), f"{BUCKET}/corpus/train/part-00000.parquet")
    fs.put_file(os.path.join(EMBEDDED, "val", "part-00000.parquet"), f"{BUCKET}/corpus/val/part-00000.parquet")
    fs.put_file(os.path.join(EMBEDDED, "tokenizer.json"), f"{BUCKET}/tokenizer/tokenizer.json")
    try:
        yield fs
    finally:
        s3fs.S3FileSystem.clear_instance_cache()
        server.stop()


class _TermAtBatch:
    """Sends this process SIGTERM when batch ``at`` is drawn (with train.prefetch=0: during step ``at``), as the
    reliability tests do."""

    def __init__(self, inner, at: int):
        self.inner, self.at, self.n = inner, at, 0

    def __next__(self):
        self.n += 1
        if self.n == self.at:
            os.kill(os.getpid(), signal.SIGTERM)
        return next(self.inner)

    def get_state(self):
        return self.inner.get_state()

    def set_state(self, state):
        self.inner.set_state(state)


def _cfg(output_dir, data_root):
    return load_config("configs/tiny.yaml", [
        f"train.output_dir={output_dir}", f"data.train_path={data_root}/corpus/train",
        f"data.val_path={data_root}/corpus/val/*.parquet", f"data.tokenizer.path={data_root}/tokenizer/tokenizer.json",
        "train.steps=6", "train.log_every=1", "train.eval_every=3", "train.eval_batches=1", "checkpoint.every=2",
        "train.prefetch=0", "optim.warmup_steps=1"])


def _rows(fs, url):
    return [json.loads(line) for line in fs.cat_file(url).decode().splitlines() if line.strip()]


@pytest.mark.slow
def test_train_reads_and_writes_the_bucket_and_resumes_after_sigterm(s3, tmp_path, monkeypatch, capsys):
    """The three runs compile the same steps once (the session's compile cache, tests/conftest.py)."""
    run = f"s3://{BUCKET}/runs/tiny"
    cfg = _cfg(run, f"s3://{BUCKET}")
    real = run_loop.data_lib.train_iterator
    with monkeypatch.context() as patch:
        patch.setattr(run_loop.data_lib, "train_iterator", lambda *a, **k: _TermAtBatch(real(*a, **k), at=3))
        first = train(cfg, progress=False)
    assert first.preempted and first.final_step == 3
    assert f"SIGTERM: saved a checkpoint at step 3 in {run}/checkpoints" in capsys.readouterr().out
    assert first.metrics_path == f"{run}/metrics.jsonl" and first.run_dir == run

    s3.invalidate_cache()
    bucket_run = f"{BUCKET}/runs/tiny"
    steps = sorted(int(p.rsplit("/", 1)[-1]) for p in s3.ls(f"{bucket_run}/checkpoints"))
    assert steps == [2, 3]
    for step in steps:  # uploaded whole: the manifest (written last) lists every file, with its size
        manifest = json.loads(s3.cat_file(f"{bucket_run}/checkpoints/{step}/manifest.mixerlab.json"))
        for rel, digest in manifest["files"].items():
            assert s3.size(f"{bucket_run}/checkpoints/{step}/{rel}") == digest["size"]
    assert [r["step"] for r in _rows(s3, f"{bucket_run}/metrics.jsonl") if r["split"] == "train"] == [1, 2, 3]
    assert [r["step"] for r in _rows(s3, f"{bucket_run}/metrics.jsonl") if r["split"] == "val"] == [3]
    for name in ("config.yaml", "train.log", "loss_curve.png"):
        assert s3.exists(f"{bucket_run}/{name}"), name
    assert s3.ls(f"{bucket_run}/tensorboard")
    assert not os.path.exists("s3:"), "a local folder named after the URL was created"

    second = train(cfg, progress=False)  # the same command resumes from the bucket
    assert not second.preempted and sorted(second.train_losses) == [4, 5, 6]
    s3.invalidate_cache()
    assert [r["step"] for r in _rows(s3, f"{bucket_run}/metrics.jsonl") if r["split"] == "train"] == [1, 2, 3, 4, 5, 6]
    assert sorted(int(p.rsplit("/", 1)[-1]) for p in s3.ls(f"{bucket_run}/checkpoints")) == [3, 4, 6]  # keep: 3
    assert "resumed from" in s3.cat_file(f"{bucket_run}/train.log").decode()

    # The state continued: the same losses as an uninterrupted local run on the same data.
    local = train(_local_cfg(tmp_path / "local"), progress=False)
    resumed = [second.train_losses[s] for s in (4, 5, 6)]
    np.testing.assert_allclose(resumed, [local.train_losses[s] for s in (4, 5, 6)], rtol=1e-6)
    np.testing.assert_allclose([first.train_losses[s] for s in (1, 2, 3)],
                               [local.train_losses[s] for s in (1, 2, 3)], rtol=1e-6)


def _local_cfg(output_dir):
    return load_config("configs/tiny.yaml", [
        f"train.output_dir={output_dir}", f"data.train_path={EMBEDDED}/train", f"data.val_path={EMBEDDED}/val",
        f"data.tokenizer.path={EMBEDDED}/tokenizer.json", "train.steps=6", "train.log_every=1", "train.eval_every=3",
        "train.eval_batches=1", "checkpoint.every=2", "train.prefetch=0", "optim.warmup_steps=1"])


def test_a_missing_bucket_is_named_with_the_config_key(s3):
    from mixerlab.training import data as data_lib
    from mixerlab.training.run_dir import RunDirError, check_writable
    from mixerlab.training.storage import StorageError

    with pytest.raises(StorageError, match=r"data\.train_path: s3://no-such-bucket/corpus: the bucket "
                                           r"s3://no-such-bucket does not exist"):
        data_lib.resolve_parquet_files("s3://no-such-bucket/corpus", "data.train_path")
    with pytest.raises(StorageError, match=rf"data\.train_path: no \.parquet file matched the glob "
                                           rf"s3://{BUCKET}/corpus/\*\.txt"):
        data_lib.resolve_parquet_files(f"s3://{BUCKET}/corpus/*.txt", "data.train_path")
    with pytest.raises(RunDirError, match=r"train\.output_dir: s3://no-such-bucket/run: the bucket "
                                          r"s3://no-such-bucket does not exist"):
        check_writable("s3://no-such-bucket/run", "train.output_dir")


def test_missing_credentials_are_named_with_the_config_key(s3, monkeypatch):
    s3fs = pytest.importorskip("s3fs")

    from mixerlab.training import data as data_lib
    from mixerlab.training.storage import StorageError

    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(key)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # no instance-metadata lookup (no network)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent")
    s3fs.S3FileSystem.clear_instance_cache()
    with pytest.raises(StorageError, match=rf"data\.train_path: s3://{BUCKET}/corpus: no usable credentials for "
                                           rf"s3://{BUCKET} .*AWS_ACCESS_KEY_ID"):
        data_lib.resolve_parquet_files(f"s3://{BUCKET}/corpus", "data.train_path")


def test_a_failed_run_prints_one_line_and_keeps_the_details_in_the_bucket(s3, capsys):
    import train as train_cli

    run = f"s3://{BUCKET}/runs/failed"
    code = train_cli.main(["--config", "configs/tiny.yaml", f"train.output_dir={run}",
                           f"data.train_path=s3://{BUCKET}/corpus/*.txt"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and len(err) == 1, err
    assert err[0] == (f"error: data.train_path: no .parquet file matched the glob s3://{BUCKET}/corpus/*.txt "
                      f"(details: {run}/train.log)")
    s3.invalidate_cache()
    log = s3.cat_file(f"{BUCKET}/runs/failed/train.log").decode()
    assert "ERROR train.py: data.train_path: no .parquet file matched" in log and "Traceback" in log


def _small_state(value):
    import jax.numpy as jnp

    return {"w": jnp.full((4, 3), value, jnp.float32)}, {"m": jnp.zeros((4, 3), jnp.float32)}


def test_a_step_whose_upload_was_killed_is_quarantined_and_the_previous_one_restored(s3):
    """The bucket after a kill during an upload: step 4's objects, no manifest. Quarantining it moves an S3
    pseudo-folder (no object of its own); resume then continues from step 2, every time it is asked."""
    from mixerlab.training import checkpoint as checkpoint_lib

    url = f"s3://{BUCKET}/runs/killed/checkpoints"
    ckpt = checkpoint_lib.Checkpointer(url, keep=3, async_save=False)
    for step in (2, 4):
        params, opt = _small_state(float(step))
        assert ckpt.save(step, params=params, opt_state=opt, data_state={"s": step}, meta={"step": step})
    ckpt.close()
    s3.rm(f"{BUCKET}/runs/killed/checkpoints/4/{checkpoint_lib.MANIFEST}")
    s3.invalidate_cache()
    left = s3.find(f"{BUCKET}/runs/killed/checkpoints/4")
    assert left  # objects without their manifest

    for attempt in range(2):  # and a second resume finds the same state
        fresh = checkpoint_lib.Checkpointer(url, keep=3, async_save=False)
        messages = []
        template = _small_state(0.0)
        step, params, _opt, data, _meta = fresh.restore_newest(params=template[0], opt_state=template[1],
                                                              report=messages.append)
        fresh.close()
        assert step == 2 and float(params["w"][0, 0]) == 2.0 and data == {"s": 2}
        if attempt == 0:
            assert len(messages) == 1 and "its upload did not finish" in messages[0], messages
        else:
            assert messages == []
    s3.invalidate_cache()
    assert not s3.exists(f"{BUCKET}/runs/killed/checkpoints/4")
    moved = sorted(p.split("/checkpoints.quarantine/4/")[1] for p in
                   s3.find(f"{BUCKET}/runs/killed/checkpoints.quarantine/4"))
    assert moved == sorted(p.split("/checkpoints/4/")[1] for p in left)


def test_a_run_directory_in_a_bucket_is_locked_with_a_heartbeat(s3, monkeypatch):
    import socket

    from mixerlab.training import run_lock
    from mixerlab.training.run_dir import RunDirError

    monkeypatch.setattr(run_lock, "SETTLE_S", 0.05)
    run = f"s3://{BUCKET}/runs/locked"
    with run_lock.RunLock(run) as lock:
        holder = json.loads(s3.cat_file(f"{BUCKET}/runs/locked/{run_lock.LOCK_NAME}"))
        assert holder["token"] == lock.token and holder["host"] == socket.gethostname()
        with pytest.raises(RunDirError, match=rf"{run} is in use by another trainer \(host "):
            run_lock.RunLock(run).acquire()
    s3.invalidate_cache()
    assert not s3.exists(f"{BUCKET}/runs/locked/{run_lock.LOCK_NAME}")

    # a lock object whose heartbeat stopped (another host: its pid cannot be checked) is taken over
    stale = {"host": "another-host", "pid": 1, "started": 0, "heartbeat": 0, "token": "t"}
    s3.pipe_file(f"{BUCKET}/runs/locked/{run_lock.LOCK_NAME}", json.dumps(stale).encode())
    said = []
    with run_lock.RunLock(run, report=said.append) as lock:
        s3.invalidate_cache()
        assert json.loads(s3.cat_file(f"{BUCKET}/runs/locked/{run_lock.LOCK_NAME}"))["token"] == lock.token
    assert "host another-host" in said[0] and "heartbeat is" in said[0]
