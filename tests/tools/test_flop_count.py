"""tools/flop_count.py: model FLOPs per step on the configured data against one document per row."""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "tools"))

import flop_count  # noqa: E402


def test_counts_the_data_documents_and_whole_rows():
    r = flop_count.count("configs/tiny.yaml", ["train.batch_size=4", "data.seq_len=256"], batches=2)
    assert r["pairs_full_rows"] == 4 * 256 * 257 / 2
    assert 0 < r["pairs_data"] < r["pairs_full_rows"] and r["pieces_per_row"] > 1  # the embedded corpus's documents
    assert r["step_data"] == pytest.approx(r["per_token"] * 1024 + r["per_attention_pair"] * r["pairs_data"])
    assert r["step_full_rows"] > r["step_data"]
