"""mixerlab: token mixers (linear attention, delta rules, state-space layers) and their Pallas kernels in JAX.

The code lives in the repository's top-level folders (``mixers/``, ``pallas_kernels/``, ``models/``,
``training/``, ``eval/``, ``interop/``, ``configs/``) and is imported as ``mixerlab.<folder>``:

    from mixerlab import mixers
    from mixerlab.pallas_kernels import delta_rule

In a checkout (and an editable install) ``mixerlab/<folder>`` is a relative symlink to ``../<folder>``, so
Python and static tools (pyright, IDEs) find ``mixerlab.mixers`` by the ordinary file-system lookup; a wheel
holds real folders under ``mixerlab/`` (pyproject.toml maps each top-level folder there). docs/architecture.md
says why.
"""
from __future__ import annotations

__version__ = "0.1.0"
