"""The process environment a command picks before JAX starts: on a machine without a GPU or TPU, the CPU backend
and a quiet libtpu (the same settings the Makefile exports for PLATFORM=cpu).

Without them every command on a CPU machine that has libtpu installed (the CPU lock installs it, to compile
TPU programs) prints libtpu's ``unexpected worker hostname`` errors while JAX looks for a TPU. Nothing the user
set is overridden, and nothing is set where a GPU or TPU is present.
"""
from __future__ import annotations

import glob
import os
import sys
from typing import MutableMapping

# what the Makefile exports for PLATFORM=cpu; JAX_PLATFORMS first (the others only quiet libtpu)
CPU_SETTINGS = {"JAX_PLATFORMS": "cpu", "TPU_ACCELERATOR_TYPE": "v5litepod-4", "TPU_WORKER_HOSTNAMES": "localhost",
                "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}
GPU_DEVICES = ("/dev/nvidia[0-9]*", "/proc/driver/nvidia/gpus/*")  # an NVIDIA GPU with its driver loaded
TPU_DEVICES = ("/dev/accel*", "/dev/vfio/[0-9]*")  # TPU VMs (v2-v4: accel; v5e/v6e: vfio)


def detect_platform(root: str = "/") -> str:
    """'cuda', 'tpu' or 'cpu', from the device files the drivers create (no library is loaded)."""
    def present(patterns):
        return any(glob.glob(os.path.join(root, p.lstrip("/"))) for p in patterns)

    if present(GPU_DEVICES):
        return "cuda"
    if present(TPU_DEVICES):
        return "tpu"
    return "cpu"


def quiet_cpu_setup(environ: MutableMapping[str, str] | None = None, platform: str | None = None) -> dict:
    """On a machine without a GPU or TPU: sets each of CPU_SETTINGS that the environment does not set yet, and
    JAX's platform when JAX is already imported (it reads JAX_PLATFORMS at import) and the user did not choose
    one. Returns the settings it made ({} elsewhere). Call it first in every command's main()."""
    env = os.environ if environ is None else environ
    if (platform or detect_platform()) != "cpu":
        return {}
    made = {key: value for key, value in CPU_SETTINGS.items() if key not in env}
    env.update(made)
    if environ is None and "JAX_PLATFORMS" in made and "jax" in sys.modules:
        sys.modules["jax"].config.update("jax_platforms", "cpu")  # no effect once a backend is running
    return made


def select_test_platform(environ: MutableMapping[str, str] | None = None,
                         platform: str | None = None) -> tuple[str, str]:
    """The JAX platform of a test session and why (tests/conftest.py; its report header prints both).

    JAX_PLATFORMS set by the user or the Makefile wins. Otherwise the machine decides: without a GPU or TPU the
    CPU settings above; with one, ``JAX_PLATFORMS=<it>,cpu`` (its tests run on it, the CPU backend stays
    available to the tests that ask for it by name) and, on a GPU, no preallocation (the test process and the
    processes it starts share the one GPU)."""
    env = os.environ if environ is None else environ
    if "JAX_PLATFORMS" in env:
        chosen, why = env["JAX_PLATFORMS"] or "JAX's default", "JAX_PLATFORMS is set"
    else:
        found = platform or detect_platform()
        if found == "cpu":
            env["JAX_PLATFORMS"] = chosen = "cpu"
            why = "no GPU or TPU found"
        else:
            env["JAX_PLATFORMS"] = chosen = f"{found},cpu"
            why = f"{'a GPU' if found == 'cuda' else 'a TPU'} found"
            if found == "cuda":
                env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    if chosen == "cpu":  # libtpu is loaded on CPU too (TPU topology compiles): keep it quiet
        for key, value in CPU_SETTINGS.items():
            env.setdefault(key, value)
    return chosen, why
