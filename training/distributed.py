"""Multi-host start-up: ``jax.distributed.initialize`` before anything touches the devices.

* On a TPU pod slice (or a SLURM / Kubernetes job JAX can detect), ``--distributed`` calls
  ``jax.distributed.initialize()`` and JAX finds the coordinator and the process ids itself.
* Anywhere else (several GPU hosts, or processes on one machine), pass ``--coordinator_address host:port
  --num_processes N --process_id i`` (one process per host/GPU group).
Every process then loads only its own data shard (training/data.py), takes part in every checkpoint, and
only process 0 writes logs and metrics.

Failures end every process with one line instead of a hang or JAX's fatal log (docs/launch.md lists them):
start-up is bounded by ``--distributed_timeout`` (a coordinator nobody answers at, a process that never joins),
bad flags and a mesh the world size does not fit are refused at once, and after a failed run (another process
died: the next collective fails) the process exits without JAX's exit barrier, which would wait for the dead one.
"""
from __future__ import annotations

import logging
import os
import socket
import sys
import threading
import time

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


TIMEOUT_FLAG = "--distributed_timeout"
DEFAULT_TIMEOUT_S = 300  # start-up of every process, and how long a lost process goes unnoticed at worst
_JAX_MARGIN_S = 30  # JAX's own deadlines come this much later: our one-line message goes out first


def initialize(*, distributed: bool, coordinator_address: str | None, num_processes: int | None,
               process_id: int | None, local_device_ids: list[int] | None = None,
               timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    """Joins the processes of a multi-process run (nothing for a single process). Every failure to start is one
    line that names the flag (UsageError, exit 2, for a bad value; a runtime error, exit 1, when the processes do
    not all arrive within ``timeout_s``): JAX itself would abort with a fatal log and a stack dump."""
    from mixerlab.training.cli_errors import UsageError

    if timeout_s <= 0:
        raise UsageError(f"{TIMEOUT_FLAG}: must be > 0 seconds, got {timeout_s:g}")
    explicit = [coordinator_address, num_processes, process_id]
    if any(x is not None for x in explicit):
        if any(x is None for x in explicit):
            raise UsageError("--coordinator_address, --num_processes and --process_id must be given together")
        host, port = _split_address(coordinator_address)
        if num_processes < 1:
            raise UsageError(f"--num_processes: must be >= 1, got {num_processes}")
        if not 0 <= process_id < num_processes:
            raise UsageError(f"--process_id: {process_id} is not in [0, --num_processes={num_processes}): process ids "
                             f"are 0 .. {num_processes - 1}, one per process")
        _cpu_collectives()
        what = (f"--num_processes={num_processes} processes did not all join the coordinator at "
                f"--coordinator_address={coordinator_address} within {TIMEOUT_FLAG}={timeout_s:g} s (this is "
                f"--process_id={process_id}); start every process id 0 .. {num_processes - 1} with the same address")
        start = time.monotonic()
        if process_id != 0:  # a clearer message when nothing listens there at all
            _wait_for_coordinator(host, port, coordinator_address, timeout_s)
        with _Deadline(max(timeout_s - (time.monotonic() - start), 1.0), what):
            jax.distributed.initialize(coordinator_address=coordinator_address, num_processes=num_processes,
                                       process_id=process_id, local_device_ids=local_device_ids,
                                       **_timeouts(timeout_s))
    elif distributed:
        with _Deadline(timeout_s, f"--distributed: the processes of this job did not all start within "
                                  f"{TIMEOUT_FLAG}={timeout_s:g} s"):
            jax.distributed.initialize(**_timeouts(timeout_s))


def _timeouts(timeout_s: float) -> dict:
    """JAX's deadlines: start-up, a silent peer (heartbeat), the barrier at exit."""
    t = int(timeout_s) + _JAX_MARGIN_S
    return {"initialization_timeout": t, "heartbeat_timeout_seconds": max(int(timeout_s), 1),
            "shutdown_timeout_seconds": t}


def _split_address(address: str) -> tuple[str, int]:
    from mixerlab.training.cli_errors import UsageError

    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise UsageError(f"--coordinator_address: expected host:port (e.g. 10.0.0.2:1234), got {address!r}")
    return host.strip("[]"), int(port)


def _wait_for_coordinator(host: str, port: int, address: str, timeout_s: float) -> None:
    """Retries a TCP connection to the coordinator (process 0 may start later) until ``timeout_s``."""
    deadline, last = time.monotonic() + timeout_s, None
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, port), timeout=min(5.0, timeout_s)):
                return
        except OSError as e:
            last = e
            time.sleep(0.5)
    why = last.strerror if isinstance(last, OSError) and last.strerror else last
    raise DistributedError(f"--coordinator_address={address}: nothing accepted a connection there within "
                           f"{TIMEOUT_FLAG}={timeout_s:g} s ({why}); start process 0 there, or check the host, port "
                           f"and firewall")


class DistributedError(RuntimeError):
    """The processes of a run could not start or keep running together (exit code 1)."""


class _Deadline:
    """Ends the process with one line if the block has not finished after ``timeout_s`` (JAX would abort later
    with a fatal log and a stack dump, or wait for a process that never comes)."""

    def __init__(self, timeout_s: float, message: str):
        self.timer = threading.Timer(timeout_s, self._expire, args=(message,))
        self.timer.daemon = True

    @staticmethod
    def _expire(message: str) -> None:
        print(f"mixerlab-train: error: {message}", file=sys.stderr, flush=True)
        os._exit(1)

    def __enter__(self):
        self.timer.start()
        return self

    def __exit__(self, *exc):
        self.timer.cancel()


def exit_now(code: int) -> int:
    """After a failure in a multi-process run: ends this process at once (exit ``code``) instead of returning.
    A normal exit runs JAX's shutdown barrier, which waits for every process — for a dead one until the
    heartbeat times out, then aborts with a stack dump. Single-process runs just return ``code``."""
    if jax.process_count() > 1:
        sys.stdout.flush()
        sys.stderr.flush()
        logging.shutdown()
        os._exit(code)
    return code


# what a collective or the coordination service raises when another process is gone (gloo on CPU, NCCL on GPU)
_LOST_PROCESS_SIGNS = ("Gloo", "Connection reset by peer", "Connection closed by peer", "NCCL", "heartbeat timeout",
                       "coordination service", "Socket closed")


def lost_process_line(e: BaseException, line: str) -> str:
    """The error line of a multi-process run, saying so when the failure is a lost process (not this one's)."""
    if jax.process_count() < 2 or not any(sign in str(e) for sign in _LOST_PROCESS_SIGNS):
        return line
    return (f"another process of this run stopped or cannot be reached (this is process {jax.process_index()} of "
            f"{jax.process_count()}); run the same command on every host to resume from the newest complete "
            f"checkpoint. {line}")


def check_mesh(cfg) -> None:
    """The mesh against the devices of all processes, before anything else is built: a mesh that the world size
    does not fit is named with the process count (every process raises the same UsageError)."""
    from mixerlab.training import mesh as mesh_lib
    from mixerlab.training.cli_errors import UsageError

    devices = jax.devices()
    slices = len({getattr(d, "slice_index", 0) for d in devices})
    try:
        mesh_lib.mesh_shape(cfg, len(devices), slices)
    except ValueError as e:
        raise UsageError(f"{e} ({jax.process_count()} process(es) × {jax.local_device_count()} device(s) each = "
                         f"{len(devices)} devices)") from None


def _cpu_collectives() -> None:
    """CPU processes need a collectives backend to talk to each other (gloo ships with jaxlib)."""
    try:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    except Exception:  # option renamed/removed in a later jax: the default then works
        pass
