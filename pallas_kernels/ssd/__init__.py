"""Grouped scalar-decay linear attention (Mamba-2's SSD layer): ``ssd``. Math in docs/math/ssd.md."""
from mixerlab.pallas_kernels.ssd.api import ssd  # noqa: F401
