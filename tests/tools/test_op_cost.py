"""tools/op_cost.py: compiled cost of an op at a small shape, and the HLO buffer parser."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tools"))
import op_cost  # noqa: E402


def test_buffer_parser_sums_shapes_per_op():
    hlo = ("  %a = f32[2,4]{1,0} multiply(f32[2,4]{1,0} %x, f32[2,4]{1,0} %y)\n"
           "  %b = f32[2,4]{1,0} multiply(f32[2,4]{1,0} %a, f32[2,4]{1,0} %y)\n"
           "  ROOT %c = bf16[8]{0} convert(f32[8]{0} %z)\n  %t = (f32[2], f32[2]) tuple(%p, %q)\n")
    assert op_cost.largest_buffers(hlo, 5, 0) == [(64, "f32[2,4]", "multiply"), (16, "bf16[8]", "convert")]


def test_attention_cost_table(capsys):
    assert op_cost.main(["--op", "attention", "--impl", "xla", "--length", "64", "--heads", "2", "--dim", "16",
                         "--top", "3"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| forward")]
    assert len(rows) == 2  # forward and forward+backward
    gflop = [float(r.split("|")[2]) for r in rows]
    assert 0 < gflop[0] < gflop[1]  # the backward adds work
    assert "largest buffers of the forward" in out
