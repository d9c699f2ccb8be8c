"""mixerlab: token mixers (linear attention, delta rules, state-space layers) and their Pallas kernels in JAX.

The code lives in the repository's top-level folders (``mixers/``, ``pallas_kernels/``, ``models/``,
``training/``, ``eval/``) and is imported as ``mixerlab.<folder>``:

    from mixerlab import mixers
    from mixerlab.pallas_kernels import delta_rule

Two layouts give the same names:
  * an installed wheel holds ``mixerlab/mixers/...`` etc. (pyproject.toml maps each folder into this package);
  * a checkout (``python train.py``, ``python -m pytest``, an editable install) runs this file from
    ``<repo>/mixerlab/``; it then also searches the repository root for subpackages, so
    ``mixerlab.mixers`` is ``<repo>/mixers``. Only a root whose pyproject.toml names this project counts, so
    a wheel installed next to some other project's files never picks them up.
"""
from __future__ import annotations

import os
import re

__version__ = "0.1.0"

_PROJECT_NAME = re.compile(r'^name\s*=\s*"mixerlab"\s*$', re.MULTILINE)


def _checkout_root() -> str | None:
    """The repository root when this file runs from a checkout, else None (an installed wheel)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        with open(os.path.join(root, "pyproject.toml"), encoding="utf-8") as f:
            text = f.read()
    except OSError:
        return None
    return root if _PROJECT_NAME.search(text) else None


_ROOT = _checkout_root()
if _ROOT is not None and _ROOT not in __path__:
    __path__.append(_ROOT)
