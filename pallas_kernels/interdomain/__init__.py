"""The interdomain op (IA's complex diagonal S4D memory with a query readout) and the S4D-only core:
reference, chunkwise XLA (autodiff) and decode steps. See docs/interdomain.md."""
from mixerlab.pallas_kernels.interdomain.api import (InterdomainState, interdomain, interdomain_step, readout_matrix,
                                            readout_vector, s4d, s4d_inv_imag, s4d_step, zoh_input_gain)

__all__ = ["InterdomainState", "interdomain", "interdomain_step", "readout_matrix", "readout_vector", "s4d",
           "s4d_inv_imag", "s4d_step", "zoh_input_gain"]
