"""Orbax checkpoints of everything a run needs to continue bit-for-bit: parameters, optimizer state, the
grain iterator position and the step. Keeps the newest ``checkpoint.keep``; resume takes the newest good one.

Every finished save gets a manifest (``<step>/manifest.mixerlab.json``: size and CRC32 of each file) as soon
as orbax reports the step complete (asynchronous saves: from a background thread, not at the next save). On
restore the manifest is checked; a step without one (killed between the save and its manifest) gets the checks
that need none: every parameter and optimizer value finite and of a plausible magnitude, every shape the
model's. A step that fails a check, fails to restore or holds non-finite values is moved to
``<run dir>/checkpoints.quarantine/`` (so it neither blocks later saves at its step nor counts toward ``keep``)
and the next older step is tried.

The directory may be a gs:// or s3:// URL (see ``Checkpointer`` for how each is written).
"""
from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import tempfile
import threading
import zlib

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

from mixerlab.training import storage

log = logging.getLogger(__name__)

MANIFEST = "manifest.mixerlab.json"
_CHUNK = 1 << 22
ORBAX_PROTOCOLS = ("gs",)  # URLs orbax (TensorStore) writes itself; other URLs are staged locally and uploaded


class CheckpointError(RuntimeError):
    """A checkpoint could not be written; the message says why in one line."""


def short_error(e: BaseException, limit: int = 200) -> str:
    """One line of an exception (TensorStore/orbax errors run to dozens of lines)."""
    text = " ".join(str(e).split())
    if len(text) > limit:
        text = text[:limit] + " ..."
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def disk_full(e: BaseException) -> bool:
    """Whether ``e`` or anything it was raised from is ENOSPC (orbax/TensorStore wrap the OSError)."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno == errno.ENOSPC:
            return True
        if "No space left on device" in str(e):
            return True
        e = e.__cause__ or e.__context__
    return False


def _file_digest(path: str) -> dict:
    crc, size = 0, 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
            size += len(chunk)
    return {"size": size, "crc32": crc}


def _remote_digests(step_dir: str) -> dict:
    """Size and the object store's own checksum of each file (from a listing; nothing is read back)."""
    return {rel: d for rel, d in storage.sizes(step_dir, "train.output_dir").items() if not rel.startswith(MANIFEST)}


def _check_remote(step_dir: str, expected: dict) -> str | None:
    got = storage.sizes(step_dir, "train.output_dir")
    for rel, want in sorted(expected.items()):
        have = got.get(rel)
        if have is None:
            return f"{rel} is missing"
        if have["size"] != want["size"]:
            return f"{rel} has {have['size']} bytes, the manifest says {want['size']}"
        if want.get("checksum") and have["checksum"] and have["checksum"] != want["checksum"]:
            return f"{rel} does not match its checksum"
    return None


def _digests(step_dir: str) -> dict:
    out = {}
    for root, _dirs, files in os.walk(step_dir):
        for name in files:
            path = os.path.join(root, name)
            rel = os.path.relpath(path, step_dir)
            if not rel.startswith(MANIFEST):  # the manifest and its temporary file
                out[rel] = _file_digest(path)
    return out


@jax.jit
def _finite(leaves):
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves]))


def all_finite(tree) -> bool:
    """Whether every floating-point value of ``tree`` is finite (one jitted reduction, cached per structure)."""
    leaves = [x for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.inexact)]
    return not leaves or bool(_finite(leaves))


# No weight or optimizer moment of a model that trains gets near this; a flipped exponent bit in a float32
# file gives values around 1e30 and more (loss ~1e28, then only skipped steps).
PLAUSIBLE_MAGNITUDE = 1e8


@jax.jit
def _largest_magnitude(leaves):
    return jnp.max(jnp.stack([jnp.max(jnp.abs(x)).astype(jnp.float32) for x in leaves]))


def implausible(tree, template, name: str) -> str | None:
    """What is wrong with restored ``tree`` without a manifest to check it against: a shape other than the
    template's, a non-finite value, or one above PLAUSIBLE_MAGNITUDE (None: nothing found)."""
    got, want = jax.tree.leaves(tree), jax.tree.leaves(template)
    if len(got) != len(want):
        return f"its {name} have {len(got)} arrays, the model {len(want)}"
    for (path, x), w in zip(jax.tree_util.tree_flatten_with_path(tree)[0], want):
        if tuple(x.shape) != tuple(w.shape):
            return f"{name} {jax.tree_util.keystr(path)} has shape {tuple(x.shape)}, the model {tuple(w.shape)}"
    leaves = [x for x in got if jnp.issubdtype(x.dtype, jnp.inexact) and x.size]
    if not leaves:
        return None
    if not bool(_finite(leaves)):
        return f"its {name} hold non-finite values"
    largest = float(_largest_magnitude(leaves))
    if largest > PLAUSIBLE_MAGNITUDE:
        return f"its {name} hold a value of magnitude {largest:.3g} (above {PLAUSIBLE_MAGNITUDE:.0e}: corrupt)"
    return None


def implausible_opt_state(tree, template) -> str | None:
    """As ``implausible`` for the optimizer state, without the magnitude bound (second moments of large
    gradients can be large legitimately)."""
    got, want = jax.tree.leaves(tree), jax.tree.leaves(template)
    if len(got) != len(want):
        return f"its optimizer state has {len(got)} arrays, the optimizer {len(want)}"
    for (path, x), w in zip(jax.tree_util.tree_flatten_with_path(tree)[0], want):
        if tuple(x.shape) != tuple(w.shape):
            return (f"optimizer state {jax.tree_util.keystr(path)} has shape {tuple(x.shape)}, the optimizer "
                    f"{tuple(w.shape)}")
    return None if all_finite(tree) else "its optimizer state holds non-finite values"


def _tree_bytes(path: str) -> int:
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.path.getsize(os.path.join(root, name))
            except OSError:
                pass
    return total


class Checkpointer:
    """Saves and restores the checkpoints of ``directory``: a local path or a URL.

    Where the bytes go: a local path or a ``gs://`` URL is handed to orbax as it is (TensorStore writes GCS
    itself, from every host). Any other URL (``s3://``: orbax's TensorStore layer writes no S3) is *staged*: orbax
    writes into a local temporary directory and each finished step is then uploaded, its manifest last, so a step
    in the bucket without a manifest is an upload that did not finish and is never restored. A restore downloads
    the step first. Staged checkpoints are written by one host (multi-host runs need gs:// or a shared folder).
    """

    def __init__(self, directory: str, *, keep: int, async_save: bool):
        self.directory = storage.absolute(directory)
        self.quarantine_dir = self.directory + ".quarantine"
        self.quarantined: list[tuple[int, str]] = []  # (step, where it went) moved aside by this process
        self._pending: list[int] = []  # saved steps whose manifest is not written yet (async saves)
        self._primary = jax.process_index() == 0
        self._async = async_save
        self.keep = keep
        self.staged = storage.is_url(self.directory) and storage.protocol(self.directory) not in ORBAX_PROTOCOLS
        if storage.is_url(self.directory):  # a missing gcsfs/s3fs is named here, not deep inside orbax
            storage.filesystem(self.directory, "train.output_dir")
        if self.staged:
            if jax.process_count() > 1:
                raise CheckpointError(
                    f"checkpoint directory {self.directory}: {storage.protocol(self.directory)}:// checkpoints are "
                    f"staged on one host and uploaded; a run of {jax.process_count()} processes needs gs:// or a "
                    f"folder every host shares (train.output_dir)")
            storage.remove_stale_staging()
            self.stage = tempfile.mkdtemp(prefix=storage.staging_prefix("checkpoints"))
            self.local_directory = os.path.join(self.stage, "checkpoints")
        else:
            self.stage = None
            self.local_directory = self.directory
        self._upload_failed = False
        self._waiter: threading.Thread | None = None  # async saves: completes the pending steps when orbax is done
        self._waiter_error: BaseException | None = None
        self._lock = threading.Lock()  # the waiter thread and the caller's thread both complete steps
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=async_save,
                                               create=True)
        with storage.errors(self.directory, "train.output_dir"):
            self.manager = ocp.CheckpointManager(self.local_directory, options=options)

    def latest_step(self) -> int | None:
        steps = self.steps()
        return steps[-1] if steps else None

    def steps(self) -> list[int]:
        """Complete steps (staged: the ones uploaded with their manifest)."""
        if self.staged:
            return [s for s in self._remote_steps() if self.has_manifest(s)]
        return sorted(self.manager.all_steps())

    def _remote_steps(self) -> list[int]:
        if not storage.exists(self.directory, "train.output_dir"):
            return []
        return sorted(int(n) for n in storage.listdir(self.directory, "train.output_dir") if n.isdigit())

    def step_dir(self, step: int) -> str:
        return storage.join(self.directory, str(step))

    def _local_step_dir(self, step: int) -> str:
        """Where orbax reads and writes ``step``: the step itself, or its staged copy."""
        return os.path.join(self.local_directory, str(step)) if self.staged else self.step_dir(step)

    # ------------------------------------------------------------------------------------------- save
    def save(self, step: int, *, params, opt_state, data_state: dict, meta: dict) -> bool:
        """Writes checkpoint ``step``; returns whether a save was made. Non-finite parameters are never
        written (False). Errors are one-line ``CheckpointError``s."""
        if not all_finite(params):
            return False
        self.finish()  # orbax waits for the previous async save anyway (and its error is reported here)
        self._make_room()
        try:
            saved = self.manager.save(step, args=ocp.args.Composite(
                params=ocp.args.StandardSave(params),
                opt_state=ocp.args.StandardSave(opt_state),
                data=ocp.args.JsonSave(data_state),
                meta=ocp.args.JsonSave(meta),
            ))
        except Exception as e:
            raise self._save_error(step, e) from e
        if saved:
            self._pending.append(step)
            if self._async:  # the manifest is written when the save completes, not when the next one starts
                self._waiter_error = None
                self._waiter = threading.Thread(target=self._complete_in_background, daemon=True,
                                                name=f"mixerlab-checkpoint-{step}")
                self._waiter.start()
            else:
                self.finish()
        return bool(saved)

    def _complete_in_background(self) -> None:
        try:
            self._complete()
        except BaseException as e:  # noqa: BLE001 - raised in the caller's thread by the next finish()
            self._waiter_error = e

    # ------------------------------------------------------------------------------------------- disk space
    def _complete_local_steps(self) -> list[int]:
        return sorted(s for s in self.manager.all_steps() if os.path.isdir(os.path.join(self.local_directory,
                                                                                            str(s))))

    def _make_room(self) -> None:
        """Deletes the oldest local step before a save when the device has less free space than the newest
        step takes: orbax prunes to ``keep`` only after a save, which a full disk never lets finish. Only when
        ``keep`` steps are already there (the save would have pruned that one anyway) and ``keep`` >= 2 (the
        newest complete step is never deleted). Single-process runs only: a delete by process 0 alone must not
        race the other processes' view of the folder."""
        if jax.process_count() > 1 or self.keep < 2 or storage.is_url(self.local_directory):
            return
        steps = self._complete_local_steps()
        if len(steps) < self.keep:
            return
        needed = _tree_bytes(os.path.join(self.local_directory, str(steps[-1])))
        free = shutil.disk_usage(self.local_directory).free
        if free >= 1.2 * needed:
            return
        oldest = steps[0]
        log.warning("checkpoint: %.0f MiB free on the device of %s, a step takes %.0f MiB: deleting the oldest "
                    "step %d before saving (checkpoint.keep=%d would delete it after the save)", free / 2**20,
                    self.local_directory, needed / 2**20, oldest, self.keep)
        try:
            self.manager.delete(oldest)
        except Exception:  # noqa: BLE001 - the save below then reports the lack of space
            log.info("deleting checkpoint step %d failed", oldest, exc_info=True)

    def _remove_partial(self, step: int) -> None:
        """Deletes what a failed save of ``step`` left (orbax's temporary folder) so that it frees its space."""
        if not self._primary or storage.is_url(self.local_directory):
            return
        for name in os.listdir(self.local_directory) if os.path.isdir(self.local_directory) else []:
            if name.startswith(f"{step}.orbax-checkpoint-tmp"):
                shutil.rmtree(os.path.join(self.local_directory, name), ignore_errors=True)

    def _save_error(self, step: int, e: BaseException) -> CheckpointError:
        if disk_full(e):
            return CheckpointError(self._disk_full_advice(step))
        if storage.is_url(self.directory) and not isinstance(e, storage.StorageError):
            e = storage.describe(e, self.directory, "train.output_dir")
        return CheckpointError(f"checkpoint step {step} could not be written to {self.directory}: {short_error(e)}")

    def _disk_full_advice(self, step: int) -> str:
        """One line: how much is free, which folders can be deleted (every complete step but the newest) and
        that the same command then resumes."""
        local = self.local_directory
        self._remove_partial(step)
        free = shutil.disk_usage(local).free if os.path.isdir(local) else 0
        steps = self._complete_local_steps() if os.path.isdir(local) else []
        newest = f"step {steps[-1]}" if steps else "step 0 (no complete checkpoint)"
        if len(steps) > 1:
            older = [os.path.join(local, str(s)) for s in steps[:-1]]
            size = sum(_tree_bytes(p) for p in older)
            shown = ", ".join(older[:4]) + (f" and {len(older) - 4} more" if len(older) > 4 else "")
            what = (f"delete older checkpoints ({shown}: {size / 2**20:.0f} MiB; the newest, "
                    f"{os.path.join(local, str(steps[-1]))}, is the one resumed from) or other files there")
        else:
            what = "delete other files there or move train.output_dir to a device with more space"
        return (f"checkpoint step {step}: no space left on the device of {local} ({free / 2**20:.0f} MiB free); "
                f"{what}, then run the same command to resume from {newest}")

    def finish(self) -> list[int]:
        """Waits for pending saves, then writes their manifests (a manifest means: this step is complete) and,
        staged, uploads them. Returns the steps completed."""
        waiter, self._waiter = self._waiter, None
        if waiter is not None:
            waiter.join()
            error, self._waiter_error = self._waiter_error, None
            if error is not None:
                if isinstance(error, CheckpointError):
                    raise error
                raise CheckpointError(f"checkpoint could not be completed in {self.directory}: "
                                      f"{short_error(error)}") from error
        return self._complete()

    def _complete(self) -> list[int]:
        with self._lock:
            return self._complete_locked()

    def _complete_locked(self) -> list[int]:
        try:
            self.manager.wait_until_finished()
        except Exception as e:
            step = self._pending[-1] if self._pending else -1
            self._pending.clear()
            raise self._save_error(step, e) from e
        done, self._pending = self._pending, []
        if self._primary:
            for step in done:
                if storage.isdir(self._local_step_dir(step)):
                    self._write_manifest(step)
                    if self.staged:
                        self._upload(step)
            if self.staged and done:
                self._prune_remote()
        return done

    def _write_manifest(self, step: int) -> None:
        step_dir = self._local_step_dir(step)
        path = storage.join(step_dir, MANIFEST)
        try:
            if storage.is_url(step_dir):  # an object appears whole when its upload completes: no temp file
                storage.write_text(path, json.dumps({"step": step, "files": _remote_digests(step_dir)}),
                                   "train.output_dir")
                return
            tmp = path + ".tmp"
            files = _digests(step_dir)
            with open(tmp, "w") as f:
                json.dump({"step": step, "files": files}, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except OSError as e:
            raise self._save_error(step, e) from e

    def _upload(self, step: int) -> None:
        """Staged: uploads a finished step, its manifest last (the manifest marks the upload complete)."""
        local, remote = self._local_step_dir(step), self.step_dir(step)
        try:
            storage.remove(remote, "train.output_dir")  # a half-uploaded step of an earlier attempt
            for root, _dirs, files in os.walk(local):
                for name in sorted(files):
                    rel = os.path.relpath(os.path.join(root, name), local).replace(os.sep, "/")
                    if rel != MANIFEST:
                        storage.upload(os.path.join(local, rel), storage.join(remote, rel), "train.output_dir")
            storage.upload(os.path.join(local, MANIFEST), storage.join(remote, MANIFEST), "train.output_dir")
        except storage.StorageError as e:
            self._upload_failed = True  # the staged copy is then the only one: close() keeps it
            storage.mark_upload_failed(self.stage, f"checkpoint step {step}: {e}")
            raise CheckpointError(f"checkpoint step {step} could not be uploaded to {remote}: {e}; the local copy "
                                  f"is kept at {local}") from e

    def _prune_remote(self) -> None:
        """Staged: the bucket keeps the newest ``keep`` complete steps, as orbax does locally."""
        complete = self.steps()
        for step in complete[:-self.keep] if self.keep else []:
            storage.remove(self.step_dir(step), "train.output_dir")

    def _fetch(self, step: int) -> None:
        """Staged: downloads ``step`` into the staging folder (once) so that orbax can read it."""
        if not self.staged or os.path.isdir(self._local_step_dir(step)):
            return
        storage.download(self.step_dir(step), self._local_step_dir(step), "train.output_dir")
        self.manager.reload()

    # ------------------------------------------------------------------------------------------- verify
    def verify(self, step: int) -> str | None:
        """None if step's files match its manifest (or it has none: saved before manifests, or killed between
        the save and the manifest); otherwise what is wrong. A staged step without a manifest is an unfinished
        upload."""
        if self.staged:
            if not self.has_manifest(step):
                return "its upload did not finish (no manifest in the bucket)"
            self._fetch(step)
        step_dir = self._local_step_dir(step)
        path = storage.join(step_dir, MANIFEST)
        if not storage.exists(path):
            return None
        try:
            expected = json.loads(storage.read_text(path))["files"]
        except (OSError, ValueError, KeyError) as e:
            return f"unreadable manifest ({short_error(e)})"
        if storage.is_url(step_dir):
            return _check_remote(step_dir, expected)
        for rel, want in sorted(expected.items()):
            full = os.path.join(step_dir, rel)
            if not os.path.exists(full):
                return f"{rel} is missing"
            got = _file_digest(full)
            if got["size"] != want["size"]:
                return f"{rel} has {got['size']} bytes, the manifest says {want['size']}"
            if got["crc32"] != want["crc32"]:
                return f"{rel} does not match its checksum"
        return None

    def has_manifest(self, step: int) -> bool:
        return storage.exists(storage.join(self.step_dir(step), MANIFEST))

    def quarantine(self, step: int, reason: str) -> str:
        """Moves step out of the checkpoint directory (kept for inspection, never deleted)."""
        storage.makedirs(self.quarantine_dir)
        target = storage.join(self.quarantine_dir, str(step))
        n = 1
        while storage.exists(target):
            n += 1
            target = storage.join(self.quarantine_dir, f"{step}.{n}")
        storage.move(self.step_dir(step), target, "train.output_dir")
        storage.write_text(target + ".reason.txt", reason + "\n", "train.output_dir")
        if self.staged:
            shutil.rmtree(self._local_step_dir(step), ignore_errors=True)
        self.quarantined.append((step, target))
        self.manager.reload()
        return target

    # ------------------------------------------------------------------------------------------- restore
    def read_meta(self, step: int) -> dict | None:
        """The JSON ``meta`` item of step (None when it cannot be read), without touching the arrays."""
        try:
            return json.loads(storage.read_text(storage.join(self.step_dir(step), "meta", "metadata")))
        except (OSError, ValueError):
            return None

    def _check_same_model(self, step: int, params) -> None:
        """RunDirError when step's parameter names differ from the model's: a checkpoint of another model is
        not corrupt and must not be quarantined (the config comparison catches this first; this covers
        checkpoints without a stored config)."""
        try:
            metadata = json.loads(storage.read_text(storage.join(self._local_step_dir(step), "params", "_METADATA")))
            stored = {tuple(k["key"] for k in v["key_metadata"]) for v in metadata["tree_metadata"].values()}
        except (OSError, ValueError, KeyError, TypeError):
            return  # unreadable metadata: the restore below fails and the step is treated as corrupt
        wanted = {tuple(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)
                  for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]}
        if stored != wanted:
            from mixerlab.training.run_dir import RunDirError

            missing, extra = sorted(wanted - stored), sorted(stored - wanted)
            show = lambda keys: ", ".join(".".join(k) for k in keys[:3]) + (" ..." if len(keys) > 3 else "")
            raise RunDirError(
                f"checkpoint step {step} in {self.directory} holds the parameters of a different model "
                f"({len(missing)} of this model's parameters missing: {show(missing) or '-'}; {len(extra)} others: "
                f"{show(extra) or '-'}); nothing was changed. Resume with the config that wrote it, or start over "
                f"with train.resume=false or a new train.output_dir")

    def restore(self, step: int, *, params, opt_state):
        """Restores into the structure (and shardings) of the given templates."""
        self._fetch(step)
        abstract = lambda tree: jax.tree.map(ocp.utils.to_shape_dtype_struct, tree)
        out = self.manager.restore(step, args=ocp.args.Composite(
            params=ocp.args.StandardRestore(abstract(params)),
            opt_state=ocp.args.StandardRestore(abstract(opt_state)),
            data=ocp.args.JsonRestore(),
            meta=ocp.args.JsonRestore(),
        ))
        return out.params, out.opt_state, out.data, out.meta

    def restore_params(self, step: int, params_template):
        """Only the parameters of checkpoint ``step`` (an orbax partial restore: the optimizer state is not
        read), into the structure, dtypes and shardings of ``params_template`` (arrays or ShapeDtypeStructs)."""
        self._fetch(step)
        out = self.manager.restore(step, args=ocp.args.Composite(params=ocp.args.StandardRestore(params_template)))
        return out.params

    def restore_newest(self, *, params, opt_state, report=print):
        """(step, params, opt_state, data_state, meta) of the newest good checkpoint, or None.
        A step that fails its manifest, fails to restore (partial write, corruption) or holds non-finite
        parameters is quarantined and reported (one line through ``report``), and the next older one is tried."""
        candidates = self._remote_steps() if self.staged else self.manager.all_steps()
        for step in sorted(candidates, reverse=True):
            problem = self.verify(step)
            restored = None
            if problem is None:
                self._check_same_model(step, params)
                try:
                    restored = self.restore(step, params=params, opt_state=opt_state)
                except Exception as e:  # orbax raises many types for truncated/corrupt files
                    log.info("restoring checkpoint step %d failed", step, exc_info=True)
                    problem = f"could not be restored ({short_error(e)})"
            if restored is not None:
                problem = self._check_restored(step, restored, params=params, opt_state=opt_state)
            if problem is None:
                return (step, *restored)
            if self._primary:
                where = self.quarantine(step, problem)
                report(f"warning: checkpoint step {step} in {self.directory}: {problem}; moved it to {where} and "
                       f"trying an older one")
            else:
                report(f"warning: checkpoint step {step}: {problem}; trying an older one")
        return None

    def _check_restored(self, step: int, restored, *, params, opt_state) -> str | None:
        """What is wrong with the restored arrays of ``step`` (None: nothing found). A step whose files matched
        its manifest needs only the finiteness checks; one without a manifest (a kill between the save and its
        manifest, or a copy without it) also gets the shape and magnitude checks, as a flipped byte there
        would otherwise go unnoticed until the loss explodes."""
        new_params, new_opt = restored[0], restored[1]
        if not self.has_manifest(step):
            log.info("checkpoint step %d has no manifest: checking its values instead", step)
            return (implausible(new_params, params, "parameters")
                    or implausible_opt_state(new_opt, opt_state))
        if not all_finite(new_params):
            return "holds non-finite parameters"
        if not all_finite(new_opt):
            return "holds a non-finite optimizer state"
        return None

    def wait(self) -> None:
        self.finish()

    def close(self) -> None:
        try:
            self.finish()
        finally:
            self.manager.close()
            if self.stage is not None and not self._pending and not self._upload_failed:
                shutil.rmtree(self.stage, ignore_errors=True)  # every finished step is in the bucket
