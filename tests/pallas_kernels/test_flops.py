"""Muir's Table 8 (docs/math/delta_rule.md): closed forms against brute-force counts, and the CLI."""
import math
import os
import subprocess
import sys

import numpy as np
import pytest

from mixerlab.pallas_kernels.delta_rule import flops as F

DEFAULT = F.KernelConfig(256, 8, 128, 128)
TREES = [(16, 2), (16, 4), (64, 8), (128, 16), (256, 8), (256, 4), (64, 64)]


# ----------------------------------------------------------------------------------------------- Table 8
def test_table8_exact_integers():
    t8 = F.table8(DEFAULT)
    assert t8 == {"leaf": 512, "cross": 63_488, "merges": 43_648, "solve": 131_072}
    assert all(type(v) is int for v in t8.values())


def test_table8_rows_in_stage_list_and_shares():
    rows = {s.name: s for s in F.forward_stages(DEFAULT, "ours") if s.table8}
    assert [s.mxu for s in rows.values()] == [512, 63_488, 43_648, 131_072]
    cross = rows["off-diag. blocks (T_cross, M_cross)"]
    assert cross.vpu == 3.5 * 5 * 128
    assert abs(cross.mxu_share - 0.966) < 0.001  # 96.6% cross-block MXU share (3.5 r d_k VPU ops)
    assert rows["2x2 block-tri. merges (11)"].mxu_share == 1.0
    assert rows["tri. solve T Z = [V̂ ‖ K̂⊙π]"].mxu_share == 1.0
    naive = {s.name: s for s in F.forward_stages(DEFAULT, "naive") if s.table8}
    assert naive["off-diag. blocks (T_cross, M_cross)"].vpu == 7 * (256 - 8) * 128
    assert naive["tri. solve T Z = [V̂ ‖ K̂⊙π]"].vpu == 256 * 256
    assert naive["2x2 block-tri. merges (11)"].mxu_share is None  # Table 8's "–"
    assert all(s.mxu == 0 for s in naive.values())


def test_other_forward_terms_of_spec_4_7():
    st = {s.name: s.mxu for s in F.forward_stages(DEFAULT, "ours")}
    assert st["Ũ = U − Y S₀"] == st["(Q̂⊙π) S₀"] == st["state update S_C"] == 32_768
    assert st["M Ũ (+ add into O)"] == 65_536
    assert st["cumulative log-decay Λ, π, E"] == 65_536
    # "The forward total, excluding the cumsum, is about 402.6k FLOPs per token per head."
    assert sum(st.values()) - st["cumulative log-decay Λ, π, E"] == 402_560


# ------------------------------------------------------------------------------ brute-force counters
class Counter:
    def __init__(self):
        self.flops = 0

    def mm(self, a, b):
        self.flops += 2 * a.shape[0] * a.shape[1] * b.shape[1]
        return a @ b


def _strict_lower(n, rng):
    return np.tril(rng.normal(size=(n, n)) * 0.3, -1)


@pytest.mark.parametrize("n0", [2, 4, 8, 16, 32])
def test_leaf_neumann_brute_force(n0):
    """Run (I−N)(I+N²)…(I+N^{n0/2}) with a counting matmul: exact inverse, 4n0²(log2 n0 − 1) per token."""
    rng = np.random.default_rng(n0)
    N, I, c = _strict_lower(n0, rng), np.eye(n0), Counter()
    prod, power = I - N, N
    while (power @ power).any():                      # stop once the next power is exactly 0 (nilpotent)
        power = c.mm(power, power)                    # N², N⁴, …
        prod = c.mm(prod, I + power)
    np.testing.assert_allclose(prod, np.linalg.inv(I + N), atol=1e-10)
    assert c.flops / n0 == F.leaf_inverse_flops(n0)


def _block_inverse(T, n0, c):
    """Recursive 2×2 block inversion (docs/math/delta_rule.md); leaves by np.linalg.inv (not counted)."""
    m = T.shape[0]
    if m == n0:
        return np.linalg.inv(T)
    h = m // 2
    PL, PR = _block_inverse(T[:h, :h], n0, c), _block_inverse(T[h:, h:], n0, c)
    P = np.zeros_like(T)
    P[:h, :h], P[h:, h:] = PL, PR
    P[h:, :h] = -c.mm(PR, c.mm(T[h:, :h], PL))
    return P


@pytest.mark.parametrize("C,n0", TREES)
def test_merges_brute_force(C, n0):
    rng = np.random.default_rng(C + n0)
    T, c = np.eye(C) + _strict_lower(C, rng) / math.sqrt(C), Counter()
    P = _block_inverse(T, n0, c)
    np.testing.assert_allclose(P @ T, np.eye(C), atol=1e-9)
    assert c.flops / C == F.merge_flops(C, n0) == pytest.approx(2 / 3 * (C * C - n0 * n0))


def _tree_nodes(C, n0):
    m = 2 * n0
    while m <= C:
        for a in range(0, C, m):
            yield a, m // 2
        m *= 2


@pytest.mark.parametrize("C,n0", TREES)
@pytest.mark.parametrize("d_k", [16, 128])
def test_cross_blocks_brute_force(C, n0, d_k):
    """Walk the tree: the cross blocks and the leaves tile the strictly-lower triangle once; the fused
    (2h×d_k)(d_k×h) matmul per node sums to 2(C−n0)d_k per token; splitting is 3.5·r·d_k VPU ops."""
    cover = np.zeros((C, C), int)
    for a in range(0, C, n0):
        cover[a:a + n0, a:a + n0] += np.tril(np.ones((n0, n0), int), -1)
    mxu = vpu = 0
    for a, h in _tree_nodes(C, n0):
        cover[a + h:a + 2 * h, a:a + h] += 1
        mxu += 2 * (2 * h) * d_k * h
        vpu += h * 4 * d_k + h * 3 * d_k     # R side: sub, exp, ×k̂, ×q̂ ; L side: sub, exp, ×k
    assert (cover == np.tril(np.ones((C, C), int), -1)).all()
    assert mxu / C == F.cross_flops(C, n0, d_k)
    assert vpu / C == F.cross_split_vpu(C, n0, d_k)


@pytest.mark.parametrize("C,n0", TREES)
def test_naive_counts_brute_force(C, n0):
    d_k, d_v = 16, 8
    leaf = np.arange(C) // n0
    off_leaf = (leaf[:, None] != leaf[None, :]).sum()  # entries of the full C×C×d_k tensor outside the leaves
    assert 7 * off_leaf * d_k / C == F.naive_decay_vpu(C, n0, d_k)
    assert 7 * (C * n0) * d_k / C == F.leaf_decay_vpu(n0, d_k)
    # forward substitution: row i does i multiply-adds per column; leading term C(d_k+d_v), exactly (C−1)(…)
    exact = sum(2 * i * (d_k + d_v) for i in range(C)) / C
    assert exact == (C - 1) * (d_k + d_v)
    assert F.forward_substitution_vpu(C, d_k, d_v) == C * (d_k + d_v)


# ---------------------------------------------------------------------------------- backward, bytes
def test_backward_structure():
    fwd, bwd = F.forward_stages(DEFAULT), F.backward_stages(DEFAULT)
    by = {s.name: s for s in bwd}
    assert by["off-diag. contraction of dA, dM"].mxu == 2 * 63_488       # 2× the forward cross cost
    assert by["transposed solve Tᵀ[dV̂ ‖ dR] = [dŨ ‖ dY]"].mxu == 131_072
    assert not any(s.table8 for s in bwd)
    ratio = F.total(bwd).mxu / F.total(fwd).mxu
    assert 2.0 < ratio < 3.0                                                 # "about 3×" incl. recompute
    assert [s.name for s in bwd] == [s.name for s in F.backward_stages(DEFAULT, "naive")]
    assert F.total(bwd).mxu_share > 0.97


def test_hbm_bytes_default():
    fwd = F.hbm_bytes(DEFAULT)
    assert sum(fwd.values()) == 2 * 4 * 128 + 4 * 128 + 2 * 128 + 4 * 128 * 128 / 256 == 2048
    assert sum(F.hbm_bytes(DEFAULT, backward=True).values()) == 5632
    assert F.hbm_bytes(F.KernelConfig(64, 8, 128, 128))["fwd write S₀"] == 4 * 128 * 128 / 64


def test_roofline_and_peaks():
    assert {k: (p.flops, p.bandwidth) for k, p in F.PEAKS.items()} == {
        "v4": (275e12, 1.2e12), "v5e": (197e12, 819e9), "v5p": (459e12, 2.76e12),
        "v6e": (918e12, 1.6e12), "H200": (790e12, 4.2e12)}
    assert all(p.source for p in F.PEAKS.values())
    r = F.roofline(197e12, 819e9 * 2, F.PEAKS["v5e"])
    assert (r.t_compute, r.t_memory, r.time, r.bound) == (1.0, 2.0, 2.0, "memory")
    assert F.roofline(2 * 918e12, 0, F.PEAKS["v6e"]).bound == "compute"


@pytest.mark.parametrize("kw", [dict(chunk=48), dict(leaf=1), dict(leaf=512), dict(d_k=0)])
def test_config_validation(kw):
    with pytest.raises(ValueError):
        F.KernelConfig(**kw)


# ------------------------------------------------------------------------------------------------- CLI
def test_cli_default(capsys):
    assert F.main([]) == 0
    out = capsys.readouterr().out
    for s in ("leaf 512, cross 63,488, merges 43,648, solve 131,072", "96.6%", "2,048", "v4", "v5e", "v5p",
              "v6e", "H200", "compute", "memory"):
        assert s in out, s
    assert "backward" not in out


def test_cli_backward(capsys):
    assert F.main(["--chunk", "64", "--leaf", "16", "--dk", "64", "--dv", "32", "--batch", "1",
                   "--seq", "128", "--heads", "2", "--backward"]) == 0
    out = capsys.readouterr().out
    assert "backward" in out and "fwd+bwd totals" in out and "256 token-heads" in out


def test_cli_rejects_bad_config(capsys):
    with pytest.raises(SystemExit) as e:
        F.main(["--leaf", "6"])
    assert e.value.code == 2


def test_cli_subprocess():
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    r = subprocess.run([sys.executable, "-m", "mixerlab.pallas_kernels.delta_rule.flops",
                        "--chunk", "128", "--leaf", "8"], cwd=root, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "Table 8 MXU rows" in r.stdout
