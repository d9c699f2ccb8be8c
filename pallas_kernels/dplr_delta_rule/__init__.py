"""The diagonal-plus-low-rank delta-rule op: reference, chunkwise XLA, the delta-rule kernels on token pairs, and
the decode step.
See docs/math/dplr_delta_rule.md."""
from mixerlab.pallas_kernels.dplr_delta_rule.api import dplr_delta_rule, dplr_delta_rule_step

__all__ = ["dplr_delta_rule", "dplr_delta_rule_step"]
