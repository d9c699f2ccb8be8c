"""The accelerators the project knows, in one table: the peak MFU is quoted against, a measured matmul rate where
the project has one, HBM size and bandwidth. Plain Python (no JAX): look a chip up by the ``device_kind`` string
JAX reports (``jax.devices()[0].device_kind``) or by its short name (the ``v5e`` of a topology ``v5e:2x2``).

``bf16_peak`` is the datasheet's **dense** bf16 matmul rate per chip (NVIDIA quotes its tensor-core rates "with
sparsity", twice the dense one; the dense one is used here). ``measured_bf16`` is a large bf16 matmul timed on the
project's own chip (docs/flops.md); MFU is reported against the datasheet peak, and against the measured rate as
a second number where there is one. A device not in the table (a CPU, a chip we have no datasheet for) has no
peak: MFU is then not shown rather than quoted against a guess.
"""
from __future__ import annotations

import dataclasses

GIB = 2**30


@dataclasses.dataclass(frozen=True)
class Chip:
    name: str                     # short name: "v5e", "H200", ...
    device_kinds: tuple[str, ...]  # the device_kind strings JAX reports for it
    bf16_peak: float              # datasheet dense bf16 matmul FLOP/s per chip
    measured_bf16: float | None   # a large bf16 matmul measured on the project's chip, FLOP/s
    hbm_bandwidth: float | None   # bytes/s (the roofline's)
    hbm_bytes: float | None       # per chip, where the compile-time memory check needs it
    source: str

    @property
    def roofline_flops(self) -> float:
        """The matmul rate of the roofline lower bounds (pallas_kernels/delta_rule/flops.py): measured where the
        project measured it, else the datasheet's."""
        return self.measured_bf16 or self.bf16_peak


CHIPS: tuple[Chip, ...] = (
    Chip("v4", ("TPU v4",), 275e12, None, 1.2e12, 32 * GIB, "Google Cloud TPU v4 datasheet (per chip)"),
    Chip("v5e", ("TPU v5 lite", "TPU v5e"), 197e12, None, 819e9, 16 * GIB, "Google Cloud TPU v5e docs"),
    Chip("v5p", ("TPU v5", "TPU v5p"), 459e12, None, 2.76e12, 95 * GIB, "Google Cloud TPU v5p docs"),
    Chip("v6e", ("TPU v6 lite", "TPU v6e"), 918e12, None, 1.6e12, 32 * GIB, "Google Cloud TPU v6e docs"),
    Chip("A100", ("NVIDIA A100-SXM4-40GB", "NVIDIA A100-SXM4-80GB", "NVIDIA A100-PCIE-40GB",
                  "NVIDIA A100 80GB PCIe"), 312e12, None, None, None, "NVIDIA A100 datasheet (dense bf16)"),
    Chip("H100 SXM", ("NVIDIA H100 80GB HBM3",), 989e12, None, None, None, "NVIDIA H100 datasheet (SXM, dense bf16)"),
    Chip("H100 PCIe", ("NVIDIA H100 PCIe",), 756e12, None, None, None, "NVIDIA H100 datasheet (PCIe, dense bf16)"),
    Chip("H200", ("NVIDIA H200",), 989e12, 790e12, 4.2e12, None,
         "NVIDIA H200 datasheet (SXM, dense bf16); measured here: bf16 matmul 790 TFLOP/s, device copy 4.2 TB/s"),
)

_BY_KIND = {kind: chip for chip in CHIPS for kind in chip.device_kinds}
_BY_NAME = {chip.name.lower(): chip for chip in CHIPS}


def by_device_kind(device_kind: str) -> Chip | None:
    """The chip whose JAX ``device_kind`` this is (exact string), else None."""
    return _BY_KIND.get(device_kind)


def by_name(name: str) -> Chip | None:
    """The chip of a short name ("v5e", "h200"; case-insensitive), else None."""
    return _BY_NAME.get(name.strip().lower())
