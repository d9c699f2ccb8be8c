"""tools/state_size.py: the decode state per layer, counted from the models' own caches."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tools"))
import state_size  # noqa: E402


def test_interdomain_state_is_the_papers_formula_and_kv_cache_grows_with_length():
    # IA paper, Table 11's text: 2 (d_feat + d_h) M real entries per head; 125M: H 12, d_h = d_feat = 64, M 64
    ia = state_size.layer_state("configs/paper/ia_interdomain_125m.yaml", 100)
    assert ia["memory_per_layer"] == 12 * 2 * (64 + 64) * 64 and ia["layers"] == 12
    assert ia["conv_per_layer"] > 0  # the q/k short convolutions' caches, listed apart
    kv = state_size.layer_state("configs/paper/ia_softmax_125m.yaml", 100)
    assert kv["memory_per_layer"] == 2 * 12 * 64 * 100 and kv["conv_per_layer"] == 0
