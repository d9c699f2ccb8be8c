"""Multi-host start-up: ``jax.distributed.initialize`` before anything touches the devices.

* On a TPU pod slice (or a SLURM / Kubernetes job JAX can detect), ``--distributed`` calls
  ``jax.distributed.initialize()`` and JAX finds the coordinator and the process ids itself.
* Anywhere else (several GPU hosts, or processes on one machine), pass ``--coordinator_address host:port
  --num_processes N --process_id i`` (one process per host/GPU group).
Every process then loads only its own data shard (training/data.py), takes part in every checkpoint, and
only process 0 writes logs and metrics.
"""
from __future__ import annotations

import os

import jax

GPU_MEMORY_ENV = "XLA_PYTHON_CLIENT_MEM_FRACTION"


def gpu_memory_share(fraction: float | None) -> str | None:
    """Give JAX's GPU allocator ``fraction`` of each GPU's memory (``train.gpu_memory_fraction``) unless
    XLA_PYTHON_CLIENT_MEM_FRACTION is already set. JAX reads the variable when it first creates its GPU client, so
    this must run before anything touches the devices; it does nothing on TPU and CPU. Returns the share in
    effect (None: JAX's default, 0.75).

    Why not JAX's 0.75: the 166M paper models at 32×4096 run without recomputation in ~92 GiB, more than 75 % of
    a 141 GB H200 leaves once ``model.remat=auto`` keeps its 20 % margin. With 0.9 ``auto`` picked no recomputation
    for GDN-2 (0.372 s against 0.426 s with ``kernels``); for Muir its estimate still exceeded the margin (``dots``)."""
    if GPU_MEMORY_ENV in os.environ or fraction is None:
        return os.environ.get(GPU_MEMORY_ENV)
    os.environ[GPU_MEMORY_ENV] = f"{fraction:g}"
    return os.environ[GPU_MEMORY_ENV]


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
