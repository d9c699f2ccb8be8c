"""tools/hlo_origin.py on a hand-written HLO module: a profiled fusion name (underscores, as profiles write them) is
found under its HLO name (a dot before the number), with its shape, its ops and the source lines of its metadata."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from tools.hlo_origin import computations, describe  # noqa: E402

MODULE = """HloModule jit__train_step

%gemm_fusion_dot.12_computation (p0: f32[8,4], p1: f32[4,4]) -> f32[8,4] {
  %p0 = f32[8,4]{1,0} parameter(0)
  %p1 = f32[4,4]{1,0} parameter(1)
  ROOT %dot.3 = f32[8,4]{1,0} dot(%p0, %p1), metadata={op_name="dot_general" source_file="ops.py" source_line=42}
}

%fused_add (q0: f32[8,4]) -> f32[8,4] {
  %q0 = f32[8,4]{1,0} parameter(0)
  ROOT %add.1 = f32[8,4]{1,0} add(%q0, %q0), metadata={op_name="add" source_file="mixerlab/model.py" source_line=7}
}

ENTRY %main (a: f32[8,4], b: f32[4,4]) -> f32[8,4] {
  %a = f32[8,4]{1,0} parameter(0)
  %b = f32[4,4]{1,0} parameter(1)
  %gemm_fusion_dot.12 = f32[8,4]{1,0} fusion(%a, %b), kind=kCustom, calls=%gemm_fusion_dot.12_computation
  ROOT %loop_add_fusion.3 = f32[8,4]{1,0} fusion(%gemm_fusion_dot.12), kind=kLoop, calls=%fused_add
}
"""


def test_profile_names_are_found_under_their_hlo_names():
    comps = computations(MODULE)
    gemm = describe("gemm_fusion_dot_12", MODULE, comps)
    assert gemm.startswith("gemm_fusion_dot_12  ->  f32[8,4]{1,0}")
    assert "dot×1" in gemm and "dot_general  @ ops.py:42" in gemm
    add = describe("loop_add_fusion_3", MODULE, comps)
    assert "add  @ mixerlab/model.py:7" in add


def test_an_unknown_fusion_says_so():
    assert describe("input_reduce_fusion_99", MODULE, computations(MODULE)) == "input_reduce_fusion_99: not found"
