"""Orbax checkpoints of everything a run needs to continue bit-for-bit: parameters, optimizer state, the
grain iterator position and the step. Keeps the newest ``checkpoint.keep``; resume takes the newest good one.

Every finished save gets a manifest (``<step>/manifest.mixerlab.json``: size and CRC32 of each file) once
orbax reports the step complete. On restore the manifest is checked; a step that fails the check, fails to
restore or holds non-finite parameters is moved to ``<run dir>/checkpoints.quarantine/`` (so it neither
blocks later saves at its step nor counts toward ``keep``) and the next older step is tried.
"""
from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import zlib

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

log = logging.getLogger(__name__)

MANIFEST = "manifest.mixerlab.json"
_CHUNK = 1 << 22


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


class Checkpointer:
    def __init__(self, directory: str, *, keep: int, async_save: bool):
        self.directory = os.path.abspath(directory)
        self.quarantine_dir = self.directory + ".quarantine"
        self.quarantined: list[tuple[int, str]] = []  # (step, where it went) moved aside by this process
        self._pending: list[int] = []  # saved steps whose manifest is not written yet (async saves)
        self._primary = jax.process_index() == 0
        self._async = async_save
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=async_save,
                                               create=True)
        self.manager = ocp.CheckpointManager(self.directory, options=options)

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def step_dir(self, step: int) -> str:
        return os.path.join(self.directory, str(step))

    # ------------------------------------------------------------------------------------------- save
    def save(self, step: int, *, params, opt_state, data_state: dict, meta: dict) -> bool:
        """Writes checkpoint ``step``; returns whether a save was made. Non-finite parameters are never
        written (False). Errors are one-line ``CheckpointError``s."""
        if not all_finite(params):
            return False
        if self._pending:  # orbax waits for the previous async save anyway: its manifest can be written now
            self.finish()
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
            if not self._async:
                self.finish()
        return bool(saved)

    def _save_error(self, step: int, e: BaseException) -> CheckpointError:
        if disk_full(e):
            free = shutil.disk_usage(self.directory).free if os.path.isdir(self.directory) else 0
            return CheckpointError(
                f"checkpoint step {step}: no space left on the device of {self.directory} ({free / 2**20:.0f} MiB "
                f"free); free space or set checkpoint.keep lower, then run the same command to resume from the "
                f"newest complete checkpoint")
        return CheckpointError(f"checkpoint step {step} could not be written to {self.directory}: {short_error(e)}")

    def finish(self) -> list[int]:
        """Waits for pending saves, then writes their manifests (a manifest means: this step is complete).
        Returns the steps completed."""
        try:
            self.manager.wait_until_finished()
        except Exception as e:
            step = self._pending[-1] if self._pending else -1
            self._pending.clear()
            raise self._save_error(step, e) from e
        done, self._pending = self._pending, []
        if self._primary:
            for step in done:
                if os.path.isdir(self.step_dir(step)):
                    self._write_manifest(step)
        return done

    def _write_manifest(self, step: int) -> None:
        path = os.path.join(self.step_dir(step), MANIFEST)
        tmp = path + ".tmp"
        try:
            files = _digests(self.step_dir(step))
            with open(tmp, "w") as f:
                json.dump({"step": step, "files": files}, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except OSError as e:
            raise self._save_error(step, e) from e

    # ------------------------------------------------------------------------------------------- verify
    def verify(self, step: int) -> str | None:
        """None if step's files match its manifest (or it has none: saved before manifests, or killed between
        the save and the manifest); otherwise what is wrong."""
        step_dir = self.step_dir(step)
        path = os.path.join(step_dir, MANIFEST)
        if not os.path.exists(path):
            return None
        try:
            with open(path) as f:
                expected = json.load(f)["files"]
        except (OSError, ValueError, KeyError) as e:
            return f"unreadable manifest ({short_error(e)})"
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
        return os.path.exists(os.path.join(self.step_dir(step), MANIFEST))

    def quarantine(self, step: int, reason: str) -> str:
        """Moves step out of the checkpoint directory (kept for inspection, never deleted)."""
        os.makedirs(self.quarantine_dir, exist_ok=True)
        target = os.path.join(self.quarantine_dir, str(step))
        n = 1
        while os.path.exists(target):
            n += 1
            target = os.path.join(self.quarantine_dir, f"{step}.{n}")
        os.rename(self.step_dir(step), target)
        with open(target + ".reason.txt", "w") as f:
            f.write(reason + "\n")
        self.quarantined.append((step, target))
        self.manager.reload()
        return target

    # ------------------------------------------------------------------------------------------- restore
    def read_meta(self, step: int) -> dict | None:
        """The JSON ``meta`` item of step (None when it cannot be read), without touching the arrays."""
        path = os.path.join(self.step_dir(step), "meta", "metadata")
        try:
            with open(path) as f:
                return json.load(f)
        except (OSError, ValueError):
            return None

    def _check_same_model(self, step: int, params) -> None:
        """RunDirError when step's parameter names differ from the model's: a checkpoint of another model is
        not corrupt and must not be quarantined (the config comparison catches this first; this covers
        checkpoints without a stored config)."""
        try:
            with open(os.path.join(self.step_dir(step), "params", "_METADATA")) as f:
                stored = {tuple(k["key"] for k in v["key_metadata"])
                          for v in json.load(f)["tree_metadata"].values()}
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
        out = self.manager.restore(step, args=ocp.args.Composite(params=ocp.args.StandardRestore(params_template)))
        return out.params

    def restore_newest(self, *, params, opt_state, report=print):
        """(step, params, opt_state, data_state, meta) of the newest good checkpoint, or None.
        A step that fails its manifest, fails to restore (partial write, corruption) or holds non-finite
        parameters is quarantined and reported (one line through ``report``), and the next older one is tried."""
        for step in sorted(self.manager.all_steps(), reverse=True):
            problem = self.verify(step)
            restored = None
            if problem is None:
                self._check_same_model(step, params)
                try:
                    restored = self.restore(step, params=params, opt_state=opt_state)
                except Exception as e:  # orbax raises many types for truncated/corrupt files
                    log.info("restoring checkpoint step %d failed", step, exc_info=True)
                    problem = f"could not be restored ({short_error(e)})"
            if restored is not None and not all_finite(restored[0]):
                problem = "holds non-finite parameters"
            if problem is None:
                return (step, *restored)
            if self._primary:
                where = self.quarantine(step, problem)
                report(f"warning: checkpoint step {step} in {self.directory}: {problem}; moved it to {where} and "
                       f"trying an older one")
            else:
                report(f"warning: checkpoint step {step}: {problem}; trying an older one")
        return None

    def wait(self) -> None:
        self.finish()

    def close(self) -> None:
        try:
            self.finish()
        finally:
            self.manager.close()
