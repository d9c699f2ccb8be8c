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

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()
