"""Variational Linear Attention op: reference scan, chunkwise XLA form, decode step. See docs/vla.md."""
from mixerlab.pallas_kernels.vla.api import initial_state, jacobian_window_norm, vla, vla_diagnostics, vla_step

__all__ = ["initial_state", "jacobian_window_norm", "vla", "vla_diagnostics", "vla_step"]
