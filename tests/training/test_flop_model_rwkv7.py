"""training/flop_model.py counts RWKV-7's DPLR core (pallas_kernels/dplr_delta_rule/flops.py), not 0."""
import pytest

from mixerlab.pallas_kernels.dplr_delta_rule import flops as dplr_flops
from mixerlab.training import flop_model
from mixerlab.training.config import load_config


def test_forward_count_by_hand():
    # C = 2, K = V = 1: pairs 2·1 + 2·3 = 8; solve 1 + 1·2 = 3; outputs 3 + 2·3 + 2 = 11; state 2 + 4 + 1 = 7
    assert dplr_flops.forward_macs_per_chunk(2, 1, 1) == 29
    assert dplr_flops.training_flops_per_token(2, 1, 1) == pytest.approx(6 * 29 / 2)


def test_rwkv7_core_is_counted_per_head_and_layer():
    cfg = load_config("configs/paper/rwkv7_166m.yaml")
    per_layer, note = flop_model.core_flops_per_token(cfg, "rwkv7", cfg.data.seq_len)
    assert note is None
    assert per_layer == pytest.approx(16 * dplr_flops.training_flops_per_token(64, 64, 64))
    # the count grows with the chunk (the intra-chunk pairs are O(C) per token)
    short = load_config("configs/paper/rwkv7_166m.yaml", ["mixers.rwkv7.chunk_size=16"])
    assert 0 < flop_model.core_flops_per_token(short, "rwkv7", 4096)[0] < per_layer
