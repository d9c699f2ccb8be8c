"""Orbax checkpoints of everything a run needs to continue bit-for-bit: parameters, optimizer state, the
grain iterator position and the step. Keeps the newest ``checkpoint.keep``; resume takes the newest."""
from __future__ import annotations

import logging
import os

import jax
import orbax.checkpoint as ocp

log = logging.getLogger(__name__)


class Checkpointer:
    def __init__(self, directory: str, *, keep: int, async_save: bool):
        self.directory = os.path.abspath(directory)
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=async_save,
                                               create=True)
        self.manager = ocp.CheckpointManager(self.directory, options=options)

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def save(self, step: int, *, params, opt_state, data_state: dict, meta: dict) -> None:
        self.manager.save(step, args=ocp.args.Composite(
            params=ocp.args.StandardSave(params),
            opt_state=ocp.args.StandardSave(opt_state),
            data=ocp.args.JsonSave(data_state),
            meta=ocp.args.JsonSave(meta),
        ))

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

    def restore_newest(self, *, params, opt_state):
        """(step, params, opt_state, data_state, meta) of the newest checkpoint that restores, or None.
        A checkpoint that fails to restore (partial write, corruption) is reported and the next older one
        is tried; nothing is deleted."""
        for step in sorted(self.manager.all_steps(), reverse=True):
            try:
                return (step, *self.restore(step, params=params, opt_state=opt_state))
            except Exception as e:  # orbax raises many types for truncated/corrupt files
                msg = f"checkpoint step {step} in {self.directory} could not be restored ({type(e).__name__}: {e}); " \
                      f"trying an older one"
                log.warning(msg)
                print(f"warning: {msg}", flush=True)
        return None

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()
