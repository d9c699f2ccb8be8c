"""Token-mixer ops (no Flax here). One folder per op; the math is in docs/math/.

Note: the public functions share their folder's name (``pallas_kernels.delta_rule`` is the function);
import implementation modules with ``from mixerlab.pallas_kernels.delta_rule import xla``.
"""
from mixerlab.pallas_kernels import xla_cpu_workaround

xla_cpu_workaround.apply()  # before any import below can start a JAX backend

from mixerlab.pallas_kernels.attention import attention  # noqa: E402
from mixerlab.pallas_kernels.delta_rule import delta_rule, delta_rule_step, normalized_linear_attention  # noqa: E402
from mixerlab.pallas_kernels.dplr_delta_rule import dplr_delta_rule, dplr_delta_rule_step  # noqa: E402
from mixerlab.pallas_kernels.interdomain import interdomain, interdomain_step, s4d, s4d_step  # noqa: E402
from mixerlab.pallas_kernels.short_conv import causal_conv  # noqa: E402
from mixerlab.pallas_kernels.ssd import ssd  # noqa: E402
from mixerlab.pallas_kernels.vla.api import vla, vla_step  # noqa: E402

__all__ = ["attention", "causal_conv", "delta_rule", "delta_rule_step", "dplr_delta_rule", "dplr_delta_rule_step",
           "normalized_linear_attention", "interdomain", "interdomain_step", "s4d", "s4d_step", "ssd", "vla",
           "vla_step"]
