"""Multi-host start-up: ``jax.distributed.initialize`` before anything touches the devices.

* On a TPU pod slice (or a SLURM / Kubernetes job JAX can detect), ``--distributed`` calls
  ``jax.distributed.initialize()`` and JAX finds the coordinator and the process ids itself.
* Anywhere else (several GPU hosts, or processes on one machine), pass ``--coordinator_address host:port
  --num_processes N --process_id i`` (one process per host/GPU group).
Every process then loads only its own data shard (training/data.py), takes part in every checkpoint, and
only process 0 writes logs and metrics.
"""
from __future__ import annotations

import jax


def initialize(*, distributed: bool, coordinator_address: str | None, num_processes: int | None,
               process_id: int | None, local_device_ids: list[int] | None = None) -> None:
    explicit = [coordinator_address, num_processes, process_id]
    if any(x is not None for x in explicit):
        if any(x is None for x in explicit):
            raise ValueError("--coordinator_address, --num_processes and --process_id must be given together")
        _cpu_collectives()
        jax.distributed.initialize(coordinator_address=coordinator_address, num_processes=num_processes,
                                   process_id=process_id, local_device_ids=local_device_ids)
    elif distributed:
        jax.distributed.initialize()


def _cpu_collectives() -> None:
    """CPU processes need a collectives backend to talk to each other (gloo ships with jaxlib)."""
    try:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    except Exception:  # option renamed/removed in a later jax: the default then works
        pass
