"""Keep XLA:CPU's YNNPACK library fusions off (jaxlib 0.10.x).

With them on, the CPU train step of a model with delta-rule layers (e.g. ``model.mixer=gdn2`` in
configs/tiny.yaml) dies with SIGSEGV inside ``YnnFusionThunk`` after its first step; with
``--xla_cpu_experimental_ynn_fusion_type=`` (no library fusion types) the same run trains. The flag must be in
``XLA_FLAGS`` before JAX starts its CPU backend, so this runs when ``pallas_kernels`` is imported (every model
import goes through it). A user who sets the flag themselves keeps their value.
"""
from __future__ import annotations

import os

FLAG = "--xla_cpu_experimental_ynn_fusion_type"


def apply(environ=os.environ) -> bool:
    """Add ``FLAG=`` to XLA_FLAGS for jaxlib 0.10.x unless the flag is already there; True if added."""
    try:
        import jaxlib
    except ImportError:  # pragma: no cover
        return False
    if not str(getattr(jaxlib, "__version__", "")).startswith("0.10."):
        return False  # not seen on other versions; an unknown flag would stop XLA
    flags = environ.get("XLA_FLAGS", "")
    if FLAG in flags:
        return False
    environ["XLA_FLAGS"] = f"{flags} {FLAG}=".strip()
    return True
