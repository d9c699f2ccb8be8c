"""The delta-rule op: reference, chunkwise XLA (custom VJP) and decode step. See docs/delta_rule.md."""
from mixerlab.pallas_kernels.delta_rule.api import delta_rule, delta_rule_step, normalized_linear_attention

__all__ = ["delta_rule", "delta_rule_step", "normalized_linear_attention"]
