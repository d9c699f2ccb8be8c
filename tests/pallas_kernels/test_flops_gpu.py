"""pallas_kernels/flops_gpu.py: counts by hand for one config, kernel names = the benchmark's breakdown."""
import json
import pathlib

from pallas_kernels import flops_gpu

ROOT = pathlib.Path(__file__).resolve().parents[2]
RAW = ROOT / "docs/benchmarks/raw/delta_rule_h200_2026-11-30.json"


def test_counts_by_hand():
    c, d = 64, 128
    counts = flops_gpu.kernel_counts(chunk=c, leaf=16, dk=d, dv=d, block_k=32, sum_passes=1)
    bf16, tf32, _ = counts["K1_intra"]
    # 6 pivot levels × (A and M: C×Dk×C each) + U = P V̂ and Y = P (K̂⊙π)
    assert bf16 == 6 * 2 * (2 * c * d * c) + 2 * (2 * c * c * d)
    # decay sums: 6 levels + π, E + π again for Y (one TF32 pass each); inverse: 2·(log2 16 − 1) Neumann
    # products and 2·(6 − 4) merge products of C×C×C
    assert tf32 == 9 * (2 * c * c * d) + (6 + 4) * (2 * c ** 3)
    two_pass = flops_gpu.kernel_counts(chunk=c, leaf=16, dk=d, dv=d, block_k=32, sum_passes=2)["K1_intra"][1]
    assert two_pass - tf32 == 9 * (2 * c * c * d)
    scan = counts["K2_scan"]
    assert scan[0] == 2 * (2 * c * d * d) and scan[2] == 2 * c * d * 4 + 4 * d + 2 * d * d  # U, Y, K⊙E, Ũ; π_C; S₀
    assert "B0_intra_again" in flops_gpu.kernel_counts(save_matrices=False)


def test_roofline_and_names_match_the_benchmark():
    roof = flops_gpu.roofline_ms(flops_gpu.kernel_counts(), 8 * 4096 * 16, 64)
    assert all(t_f > 0 and t_b > 0 for t_f, t_b in roof.values())
    measured = json.loads(RAW.read_text())["timings"]["8x4096"]["ours"]["breakdown"]
    assert set(flops_gpu.kernel_counts()) <= set(measured)


def test_cli_with_measured_times(capsys):
    assert flops_gpu.main(["--measured", str(RAW)]) == 0
    out = capsys.readouterr().out
    assert "| B2b_key_grads |" in out and "| total |" in out
