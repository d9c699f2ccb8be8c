"""The grain iterators' states in a checkpoint: every process's, gathered on save; this process's on restore."""
from __future__ import annotations

import json

import jax
import numpy as np


def _all_data_states(state) -> dict:
    """Every process's grain iterator state (each host reads its own shard), gathered so that the primary
    host's checkpoint holds all of them."""
    mine = json.dumps(state).encode()
    if jax.process_count() == 1:
        return {"per_process": [json.loads(mine)]}
    from jax.experimental import multihost_utils

    length = int(np.max(multihost_utils.process_allgather(np.array([len(mine)], np.int32))))
    padded = np.zeros(length, np.uint8)
    padded[: len(mine)] = np.frombuffer(mine, np.uint8)
    everyone = np.asarray(multihost_utils.process_allgather(padded))
    return {"per_process": [json.loads(bytes(row).rstrip(b"\0")) for row in everyone]}


def _own_data_state(saved: dict) -> dict:
    states = saved["per_process"]
    if len(states) != jax.process_count():
        raise ValueError(f"the checkpoint's data state is from {len(states)} processes, this run has "
                         f"{jax.process_count()}; resume with the same number of hosts (or start a new run)")
    return states[jax.process_index()]
