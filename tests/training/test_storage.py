"""The storage layer without a network: URL handling, gs:// dispatch (a fake filesystem registered under "gs"
stands in for gcsfs), Parquet, tokenizer, run directory and checkpoint manifests over it, and the errors."""
import importlib.util
import json
import os
import shutil
import sys

import pytest

from mixerlab.training import checkpoint as checkpoint_lib
from mixerlab.training import data as data_lib
from mixerlab.training import loop, storage
from mixerlab.training.config import load_config
from mixerlab.training.run_dir import RunDirError
from mixerlab.training.tokenizer import load_tokenizer

fsspec = pytest.importorskip("fsspec", reason="fsspec is not installed (runtime extra mixerlab[cloud])")
from fsspec.registry import _registry as FSSPEC_REGISTRY  # noqa: E402
from fsspec.implementations.memory import MemoryFileSystem  # noqa: E402


EMBEDDED = "data/embedded"


class FakeGCS(MemoryFileSystem):
    """gs:// in memory; records the operations that reach it."""

    protocol = ("gs", "gcs")
    store: dict = {}
    pseudo_dirs = [""]
    calls: list = []

    @classmethod
    def _strip_protocol(cls, path):
        return super()._strip_protocol(str(path).removeprefix("gs://"))

    def _open(self, path, mode="rb", **kwargs):
        FakeGCS.calls.append(("open", path))
        if mode.startswith(("w", "a")) and not super().exists("/" + self._strip_protocol(path).split("/")[1]):
            raise FileNotFoundError(f"bucket of {path} not found")  # as GCS answers a write to a missing bucket
        return super()._open(path, mode, **kwargs)

    def glob(self, path, **kwargs):
        FakeGCS.calls.append(("glob", path))
        return super().glob(path, **kwargs)

    def exists(self, path, **kwargs):
        FakeGCS.calls.append(("exists", path))
        return super().exists(path, **kwargs)


@pytest.fixture
def gs(monkeypatch):
    """FakeGCS as the gs:// filesystem, with bucket "bkt" holding the embedded corpus and tokenizer."""
    monkeypatch.setitem(FSSPEC_REGISTRY, "gs", FakeGCS)
    FakeGCS.store.clear()
    FakeGCS.pseudo_dirs[:] = [""]
    FakeGCS.calls.clear()
    fs = fsspec.filesystem("gs")
    fs.mkdir("/bkt")
    fs.put_file(f"{EMBEDDED}/train/part-00000.parquet", "/bkt/corpus/train/part-00000.parquet")
    fs.put_file(f"{EMBEDDED}/val/part-00000.parquet", "/bkt/corpus/val/part-00000.parquet")
    fs.put_file(f"{EMBEDDED}/tokenizer.json", "/bkt/tok/tokenizer.json")
    yield fs
    FakeGCS.store.clear()


# ------------------------------------------------------------------------------------------------ names
def test_urls_are_joined_and_kept_whole_and_local_paths_are_unchanged(tmp_path):
    assert storage.join("gs://bkt/run", "checkpoints", "4") == "gs://bkt/run/checkpoints/4"
    assert storage.join("gs://bkt/run/", "/metrics.jsonl") == "gs://bkt/run/metrics.jsonl"
    assert storage.absolute("s3://bkt/run/") == "s3://bkt/run"
    assert storage.basename("gs://bkt/run") == "run" and storage.dirname("gs://bkt/run/x") == "gs://bkt/run"
    assert storage.is_url("gs://b/x") and storage.is_url("s3://b/x") and not storage.is_url("runs/x")
    assert not storage.is_url("file:///tmp/x") and storage.protocol("gs://b") == "gs"
    assert storage.join("runs/a", "b") == os.path.join("runs/a", "b")
    assert storage.absolute("runs/a") == os.path.abspath("runs/a")
    path = str(tmp_path / "f.txt")
    storage.write_text(path, "hello")
    assert storage.read_text(path) == "hello" and storage.exists(path) and storage.listdir(str(tmp_path)) == ["f.txt"]


def test_gcsfs_is_the_gs_filesystem_class():
    gcsfs = pytest.importorskip("gcsfs", reason="gcsfs is not installed (runtime extra mixerlab[cloud])")

    assert fsspec.get_filesystem_class("gs") is gcsfs.GCSFileSystem


# ------------------------------------------------------------------------------------------------ gs:// dispatch
def test_gs_urls_route_every_operation_to_the_gs_filesystem(gs):
    assert isinstance(storage.filesystem("gs://bkt/x"), FakeGCS)
    assert storage.exists("gs://bkt/corpus/train/part-00000.parquet")
    assert storage.glob("gs://bkt/corpus/*/*.parquet") == ["gs://bkt/corpus/train/part-00000.parquet",
                                                           "gs://bkt/corpus/val/part-00000.parquet"]
    assert sorted(storage.listdir("gs://bkt/corpus")) == ["train", "val"]
    storage.write_text("gs://bkt/run/config.yaml", "a: 1\n")
    assert storage.read_text("gs://bkt/run/config.yaml") == "a: 1\n"
    kinds = {c[0] for c in FakeGCS.calls}
    assert {"open", "glob", "exists"} <= kinds
    assert not os.path.exists("gs:"), "a local folder named after the URL was created"


def test_parquet_directories_globs_and_files_in_a_bucket(gs):
    local = data_lib.resolve_parquet_files(f"{EMBEDDED}/train", "data.train_path")
    for path in ("gs://bkt/corpus/train", "gs://bkt/corpus/train/", "gs://bkt/corpus/t*/*.parquet",
                 "gs://bkt/corpus/train/part-00000.parquet"):
        assert data_lib.resolve_parquet_files(path, "data.train_path") == [
            "gs://bkt/corpus/train/part-00000.parquet"], path
    assert data_lib.check_text_data("gs://bkt/corpus/train", "data.train_path") == []
    remote = data_lib._RowGroups(["gs://bkt/corpus/train/part-00000.parquet"])
    assert remote.groups == data_lib._RowGroups(local).groups
    cfg = load_config("configs/tiny.yaml", ["data.val_path=gs://bkt/corpus/val"])
    tok = load_tokenizer("byte")
    here = data_lib.eval_batches(cfg.data, tok, batch_size=2, max_batches=2)
    there = data_lib.eval_batches(cfg.data, tok, batch_size=2, max_batches=2, path=f"{EMBEDDED}/val")
    assert all((a[k] == b[k]).all() for a, b in zip(here, there) for k in a)


def test_parquet_reads_are_ranges_not_downloads(gs, monkeypatch):
    """A row group of a remote file costs reads of about its own size, not a copy of the whole object."""
    sizes = []
    real = storage.open_file

    def counting(path, mode="rb", key="", **kwargs):
        f = real(path, mode, key, **kwargs)
        read = f.read

        def counted(length=-1):
            out = read(length)
            sizes.append(len(out))
            return out
        f.read = counted
        return f

    monkeypatch.setattr(storage, "open_file", counting)
    url = "gs://bkt/corpus/train/part-00000.parquet"
    pf = data_lib.parquet_file(url)
    total = gs.size("/bkt/corpus/train/part-00000.parquet")
    rg = pf.metadata.row_group(0)
    group = sum(rg.column(i).total_compressed_size for i in range(rg.num_columns)) \
        if pf.metadata.num_row_groups > 1 else None
    sizes.clear()
    pf.read_row_group(0, columns=["text"])
    if group is None:
        pytest.skip("the embedded corpus has one row group")
    assert sum(sizes) < total and sum(sizes) <= 2 * group + 65536


def test_a_glob_that_matches_nothing_and_a_missing_bucket_name_the_key_and_the_url(gs):
    with pytest.raises(storage.StorageError, match=r"data\.train_path: no \.parquet file matched the glob "
                                                   r"gs://bkt/nothing/\*\.parquet"):
        data_lib.resolve_parquet_files("gs://bkt/nothing/*.parquet", "data.train_path")
    with pytest.raises(storage.StorageError, match=r"data\.val_path: gs://nobucket/corpus: the bucket gs://nobucket "
                                                   r"does not exist"):
        data_lib.resolve_parquet_files("gs://nobucket/corpus", "data.val_path")
    with pytest.raises(storage.StorageError, match=r"data\.tokenizer\.path: gs://bkt/tok/missing.json: does not exist"):
        load_tokenizer("hf", "gs://bkt/tok/missing.json")


def test_tokenizer_from_a_bucket_is_the_same_tokenizer(gs, tmp_path, monkeypatch):
    monkeypatch.setenv(storage.CACHE_ENV, str(tmp_path / "cache"))
    remote = load_tokenizer("hf", "gs://bkt/tok/tokenizer.json")
    local = load_tokenizer("hf", f"{EMBEDDED}/tokenizer.json")
    assert remote.vocab_size == local.vocab_size and remote.name == local.name
    assert remote.encode("storage test") == local.encode("storage test")
    assert remote.path.startswith(str(tmp_path / "cache"))


def test_missing_gcsfs_says_which_extra_to_install(monkeypatch):
    monkeypatch.delitem(FSSPEC_REGISTRY, "gs", raising=False)
    monkeypatch.setitem(sys.modules, "gcsfs", None)  # import gcsfs -> ImportError
    with pytest.raises(storage.StorageError) as err:
        data_lib.resolve_parquet_files("gs://bkt/corpus/*.parquet", "data.train_path")
    for fragment in ("data.train_path", "gs://bkt/corpus/*.parquet", "gcsfs", 'pip install "mixerlab[cloud]"'):
        assert fragment in str(err.value), (fragment, str(err.value))


def test_credential_errors_name_the_key_the_url_and_the_fix():
    pytest.importorskip("google.auth")
    from google.auth.exceptions import DefaultCredentialsError

    msg = str(storage.describe(DefaultCredentialsError("Your default credentials were not found"),
                               "gs://bkt/run", "train.output_dir"))
    assert msg.startswith("train.output_dir: gs://bkt/run: no usable credentials for gs://bkt")
    assert "gcloud auth application-default login" in msg
    botocore = pytest.importorskip("botocore.exceptions")
    msg = str(storage.describe(botocore.NoCredentialsError(), "s3://bkt/d/*.parquet", "data.train_path"))
    assert "data.train_path: s3://bkt/d/*.parquet" in msg and "AWS_ACCESS_KEY_ID" in msg


# ------------------------------------------------------------------------------------------------ run dir, checkpoints
def test_a_gs_run_dir_is_checked_with_a_probe_object_and_kept_as_a_url(gs):
    cfg = load_config("configs/tiny.yaml", ["train.output_dir=gs://bkt/runs/a/"])
    run_dir, ckpt_dir, notes = loop._check_run_dir(cfg)
    assert (run_dir, ckpt_dir, notes) == ("gs://bkt/runs/a", "gs://bkt/runs/a/checkpoints", [])
    assert not [p for p in gs.find("/bkt") if ".write-check-" in p], "the probe object was left behind"
    with pytest.raises(RunDirError, match=r"train.output_dir: gs://nobucket/run: the bucket gs://nobucket does not"):
        loop._check_run_dir(load_config("configs/tiny.yaml", ["train.output_dir=gs://nobucket/run"]))


class _RecordingManager:
    def __init__(self, directory, options=None):
        self.directory = directory

    def all_steps(self):
        return []

    def wait_until_finished(self):
        pass

    def reload(self):
        pass

    def close(self):
        pass


def test_gs_checkpoints_go_to_orbax_as_urls_and_s3_ones_are_staged(gs, monkeypatch):
    monkeypatch.setattr(checkpoint_lib.ocp, "CheckpointManager", _RecordingManager)
    direct = checkpoint_lib.Checkpointer("gs://bkt/run/checkpoints/", keep=2, async_save=False)
    assert direct.manager.directory == "gs://bkt/run/checkpoints" and not direct.staged
    assert direct.step_dir(4) == "gs://bkt/run/checkpoints/4"
    if importlib.util.find_spec("s3fs") is not None:
        staged = checkpoint_lib.Checkpointer("s3://bkt/run/checkpoints", keep=2, async_save=False)
        assert staged.staged and os.path.isabs(staged.manager.directory)
        assert not staged.manager.directory.startswith("s3:")
        staged.close()
        assert not os.path.exists(staged.stage)


def test_manifest_of_a_gs_checkpoint_comes_from_the_listing_and_catches_a_short_file(gs, monkeypatch):
    monkeypatch.setattr(checkpoint_lib.ocp, "CheckpointManager", _RecordingManager)
    ckpt = checkpoint_lib.Checkpointer("gs://bkt/run/checkpoints", keep=2, async_save=False)
    gs.pipe_file("/bkt/run/checkpoints/4/params/data", b"x" * 100)
    gs.pipe_file("/bkt/run/checkpoints/4/meta/metadata", json.dumps({"step": 4}).encode())
    ckpt._write_manifest(4)
    manifest = json.loads(gs.cat_file(f"/bkt/run/checkpoints/4/{checkpoint_lib.MANIFEST}"))
    assert manifest["files"]["params/data"]["size"] == 100 and ckpt.has_manifest(4)
    assert ckpt.verify(4) is None and ckpt.read_meta(4) == {"step": 4}
    gs.pipe_file("/bkt/run/checkpoints/4/params/data", b"x" * 60)
    assert ckpt.verify(4) == "params/data has 60 bytes, the manifest says 100"
    where = ckpt.quarantine(4, "short file")
    assert where == "gs://bkt/run/checkpoints.quarantine/4"
    assert not gs.exists("/bkt/run/checkpoints/4") and gs.cat_file("/bkt/run/checkpoints.quarantine/4.reason.txt")


def _small_state(value: float):
    import jax.numpy as jnp

    return {"w": jnp.full((4, 3), value, jnp.float32)}, {"m": jnp.zeros((4, 3), jnp.float32)}


def test_staged_checkpoints_upload_manifest_last_and_an_unfinished_upload_is_never_restored(tmp_path, monkeypatch):
    """Any URL orbax does not write itself (s3://; here memory://, no server needed) is staged locally and
    uploaded; the bucket keeps checkpoint.keep steps; a step without its manifest is skipped on restore."""
    url = f"memory://staged-{tmp_path.name}/run/checkpoints"
    mem = fsspec.filesystem("memory")
    ckpt = checkpoint_lib.Checkpointer(url, keep=2, async_save=False)
    assert ckpt.staged
    for step in (1, 2, 3):
        params, opt = _small_state(float(step))
        assert ckpt.save(step, params=params, opt_state=opt, data_state={"s": step}, meta={"step": step})
    ckpt.close()
    assert not os.path.exists(ckpt.stage), "the staging folder outlived a clean close"
    root = mem._strip_protocol(url)
    assert sorted(mem.ls(root, detail=False)) == [f"{root}/2", f"{root}/3"]
    manifest = json.loads(mem.cat_file(f"{root}/3/{checkpoint_lib.MANIFEST}"))
    assert all(mem.size(f"{root}/3/{rel}") == d["size"] for rel, d in manifest["files"].items())

    mem.rm(f"{root}/3/{checkpoint_lib.MANIFEST}")  # as if the upload of step 3 was cut off before its manifest
    fresh = checkpoint_lib.Checkpointer(url, keep=2, async_save=False)
    assert fresh.steps() == [2]
    template = _small_state(0.0)
    messages = []
    step, params, _opt, data, meta = fresh.restore_newest(params=template[0], opt_state=template[1],
                                                          report=messages.append)
    assert step == 2 and float(params["w"][0, 0]) == 2.0 and data == {"s": 2} and meta == {"step": 2}
    assert "its upload did not finish" in messages[0] and not mem.exists(f"{root}/3")

    def failing_upload(local, target, key=""):
        raise storage.StorageError(f"{key}: {target}: connection reset")

    monkeypatch.setattr(storage, "upload", failing_upload)
    params, opt = _small_state(4.0)
    with pytest.raises(checkpoint_lib.CheckpointError, match=r"step 4 could not be uploaded .*connection reset; "
                                                               r"the local copy is kept at "):
        fresh.save(4, params=params, opt_state=opt, data_state={}, meta={})
    fresh.close()
    assert os.path.isdir(os.path.join(fresh.local_directory, "4")), "the only copy of step 4 was deleted"
    shutil.rmtree(fresh.stage)
    mem.rm(mem._strip_protocol(f"memory://staged-{tmp_path.name}"), recursive=True)


def test_eval_finds_a_run_in_a_bucket_and_writes_its_outputs_there(gs):
    from mixerlab.eval.checkpoint import resolve_run_dirs
    from mixerlab.eval.report import write_json

    gs.pipe_file("/bkt/runs/a/config.yaml", b"model: {}\n")
    gs.pipe_file("/bkt/runs/a/checkpoints/2/meta/metadata", b"{}")
    assert resolve_run_dirs("gs://bkt/runs/a/") == ("gs://bkt/runs/a", "gs://bkt/runs/a/checkpoints")
    assert resolve_run_dirs("gs://bkt/runs/a/checkpoints") == ("gs://bkt/runs/a", "gs://bkt/runs/a/checkpoints")
    with pytest.raises(FileNotFoundError, match="no such directory"):
        resolve_run_dirs("gs://bkt/runs/missing")
    write_json("gs://bkt/runs/a/eval/result.json", {"loss": 1.5, "nan": float("nan")})
    assert json.loads(gs.cat_file("/bkt/runs/a/eval/result.json")) == {"loss": 1.5, "nan": "nan"}


class PseudoFolderStore(MemoryFileSystem):
    """An object store as S3 and GCS are: a "folder" is only a common prefix, with no object of its own.
    ``mv(recursive=True)`` behaves as s3fs's does on such a prefix (seen against moto): it copies every object
    and then raises FileNotFoundError for the prefix itself, leaving the originals in place."""

    protocol = ("gs", "gcs")
    store: dict = {}
    pseudo_dirs = [""]

    @classmethod
    def _strip_protocol(cls, path):
        return super()._strip_protocol(str(path).removeprefix("gs://"))

    def mv(self, path1, path2, recursive=False, **kwargs):
        if recursive and self.isdir(path1):
            for f in self.find(path1):
                self.cp_file(f, path2.rstrip("/") + f[len(path1.rstrip("/")):])
            raise FileNotFoundError("The specified key does not exist.")
        return super().mv(path1, path2, recursive=recursive, **kwargs)


def test_moving_a_pseudo_folder_moves_each_object(monkeypatch):
    """What quarantining an unfinished upload needs on gs:// and s3://: the step's objects end up under the
    target and nowhere else (the same function serves both protocols)."""
    monkeypatch.setitem(FSSPEC_REGISTRY, "gs", PseudoFolderStore)
    PseudoFolderStore.store.clear()
    fs = fsspec.filesystem("gs")
    for rel in ("params/a", "params/sub/b", "meta/metadata"):
        fs.pipe_file(f"/bkt/run/checkpoints/25/{rel}", rel.encode())
    fs.pipe_file("/bkt/run/checkpoints/20/meta/metadata", b"keep")
    storage.move("gs://bkt/run/checkpoints/25", "gs://bkt/run/checkpoints.quarantine/25")
    assert sorted(fs.find("/bkt/run")) == [
        "/bkt/run/checkpoints.quarantine/25/meta/metadata", "/bkt/run/checkpoints.quarantine/25/params/a",
        "/bkt/run/checkpoints.quarantine/25/params/sub/b", "/bkt/run/checkpoints/20/meta/metadata"]
    assert fs.cat_file("/bkt/run/checkpoints.quarantine/25/params/sub/b") == b"params/sub/b"
    storage.move("gs://bkt/run/checkpoints/20/meta/metadata", "gs://bkt/run/one-object")  # a single object
    assert fs.cat_file("/bkt/run/one-object") == b"keep" and not fs.exists("/bkt/run/checkpoints/20")
    PseudoFolderStore.store.clear()


def test_staging_folders_of_killed_processes_are_removed_and_live_or_failed_ones_kept(tmp_path, monkeypatch):
    import subprocess
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # its pid names a process that is no longer running
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        folders = {
            "dead_checkpoints": f"mixerlab-checkpoints-{gone.pid}-abc",
            "dead_staging": f"mixerlab-staging-{gone.pid}-def",
            "dead_failed": f"mixerlab-staging-{gone.pid}-ghi",
            "live": f"mixerlab-checkpoints-{live.pid}-jkl",
            "other": "mixerlab-output-xyz",
        }
        for name in folders.values():
            (tmp_path / name / "checkpoints").mkdir(parents=True)
        # the marker a failed upload leaves (its message named the folder as the only copy)
        (tmp_path / folders["dead_failed"] / "UPLOAD-FAILED.txt").write_text("metrics.jsonl: upload failed\n")
        staging = storage.Staging("gs://bkt/run")  # a remote run's staging folder clears the stale ones first
        kept = sorted(os.listdir(tmp_path))
        assert folders["dead_checkpoints"] not in kept and folders["dead_staging"] not in kept
        for key in ("dead_failed", "live", "other"):
            assert folders[key] in kept, key
        assert os.path.basename(staging.root).startswith(f"mixerlab-staging-{os.getpid()}-")
        staging.cleanup()
    finally:
        live.kill()
        live.wait()
