"""tools/bench_ssd_gpu.py's --variants parsing on the CPU (the timings need the GPU machine): each variant becomes
the chunk and the SSD kernels' Config fields with their types, and an unknown key is refused by name."""
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from tools.bench_ssd_gpu import parse_variant  # noqa: E402


def test_variants_give_the_chunk_and_typed_config_fields():
    assert parse_variant("chunk=128,stages=2") == (128, {"stages": 2})
    assert parse_variant("warps_backward=8,split_forward=1") == (0, {"warps_backward": 8, "split_forward": True})
    assert parse_variant("chunk=64,warps_forward=4,warps_backward=2") == (64, {"warps_forward": 4,
                                                                              "warps_backward": 2})


def test_an_unknown_key_is_refused_naming_it_and_the_valid_ones():
    with pytest.raises(SystemExit, match="unknown key 'block_c'.*valid: chunk, warps_forward"):
        parse_variant("chunk=64,block_c=32")


def test_every_tunable_key_is_a_config_field():
    import dataclasses

    from mixerlab.pallas_kernels.ssd import pallas_triton
    from tools.bench_ssd_gpu import TUNABLE
    assert set(TUNABLE) <= {f.name for f in dataclasses.fields(pallas_triton.Config)}
