"""Pretrain a language model with a chosen token mixer (the checkout's entry; installed: ``mixerlab-train``).

    python train.py --config configs/base.yaml model.mixer=gdn2 train.steps=200

The command line is training/cli.py's; ``python train.py --help`` lists it.
"""
from __future__ import annotations

import sys

from mixerlab.training.cli import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
