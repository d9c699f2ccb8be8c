"""Static FLOP and HBM-byte accounting for the delta-rule chunk kernel (no JAX needed).

Counts per token and per head, for one config (chunk C, leaf n0, d_k, d_v), of every stage of
  * Muir's boundary-pivoted kernel ("ours": docs/math/delta_rule.md, 'Boundary pivots', 'Recursive block inverse'), and
  * the naive chunkwise algorithm (a C×C×d_k 3-D decay tensor and forward substitution on the VPU),
forward and backward (docs/math/delta_rule.md, 'Backward pass'), plus the HBM bytes the kernel moves, the MXU share and
a roofline time
per accelerator generation. Muir's Table 8 is reproduced exactly.

Conventions (docs/flops.md):
  * MXU FLOPs count 2 per multiply-add of a matmul, over the full operand tiles (a triangular operand is
    multiplied as a dense tile), except the 2×2 merges, whose blocks are exactly the sizes the tree gives.
  * VPU ops count 1 per elementwise op (sub, mul, add, select, exp). An exp is one VPU op (this is what
    makes Table 8's 7(C-n0)d_k and 3.5·r·d_k come out); the `exp` column repeats how many of them are
    transcendentals (the EUP's work on TPU).
  * Counts are leading terms as in Table 8 (e.g. forward substitution is C(d_k+d_v), exactly (C-1)(d_k+d_v)).
  * Table 8 is "given Λ": the MXU cumulative log-decay is a separate stage, outside the Table 8 rows.

    python -m mixerlab.pallas_kernels.delta_rule.flops --chunk 256 --leaf 8 --dk 128 --dv 128 \\
        --batch 8 --seq 4096 --heads 16 --backward
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import unicodedata
from typing import Literal, Sequence

from mixerlab.pallas_kernels import chips

Algo = Literal["ours", "naive"]


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """One kernel configuration. Byte sizes: q̂, k, k̂, v̂, o and their gradients in bf16; λ, dλ, S₀ in f32.
    ``has_erase=False``: the no-erase kernel (linear attention, gated linear attention: k̂ = 0, T = I): no
    A, no T⁻¹, no solve, no Ũ correction and none of their backward (:func:`_no_erase_chunk`)."""

    chunk: int = 256
    leaf: int = 8
    d_k: int = 128
    d_v: int = 128
    io_bytes: int = 2
    gate_bytes: int = 4
    state_bytes: int = 4
    has_erase: bool = True

    def __post_init__(self):
        for name in ("chunk", "leaf"):
            v = getattr(self, name)
            if v < 1 or v & (v - 1):
                raise ValueError(f"{name} must be a power of two, got {v}")
        if not 2 <= self.leaf <= self.chunk:
            raise ValueError(f"need 2 <= leaf <= chunk, got leaf={self.leaf}, chunk={self.chunk}")
        if self.d_k < 1 or self.d_v < 1:
            raise ValueError("d_k and d_v must be positive")

    @property
    def depth(self) -> int:
        """r = log2(C/n0), the number of tree levels above the leaves."""
        return int(math.log2(self.chunk // self.leaf))


@dataclasses.dataclass(frozen=True)
class Stage:
    """One stage's per-token, per-head cost. `exp` is the part of `vpu` that is transcendental."""

    name: str
    mxu: float = 0.0
    vpu: float = 0.0
    exp: float = 0.0
    table8: bool = False  # one of the four Table 8 rows

    @property
    def mxu_share(self) -> float | None:
        """MXU / (MXU + VPU); None when the stage does no arithmetic (Table 8's "–")."""
        total = self.mxu + self.vpu
        return self.mxu / total if total else None


# ---------------------------------------------------------------------------------------------------------
# Closed forms (per token, per head). The four Table 8 MXU rows return ints.

def cumsum_flops(C: int, d_k: int) -> int:
    """Λ = L_C λ on the MXU: a (C×C)(C×d_k) matmul per chunk → 2·C·d_k (the 'MXU cumsum')."""
    return 2 * C * d_k


def leaf_inverse_flops(n0: int) -> int:
    """Neumann product (I−N)(I+N²)…(I+N^{n0/2}): 2(log2 n0 − 1) n0³-matmuls per leaf → 4n0²(log2 n0 − 1)."""
    return 4 * n0 * n0 * (int(math.log2(n0)) - 1)


def cross_flops(C: int, n0: int, d_k: int) -> int:
    """Fused cross blocks [K̂_R⊙ρ; Q̂_R⊙ρ](K_L⊙κ)ᵀ, 4h²d_k per node → 2(C−n0)d_k (Muir, Table 8)."""
    return 2 * (C - n0) * d_k


def merge_flops(C: int, n0: int) -> int:
    """2×2 merges P_RL = −P_RR A_RL P_LL, m³/2 per node of size m → (2/3)(C² − n0²). Exact integer:
    C² − n0² = n0²(4^r − 1) is divisible by 3."""
    return 2 * (C * C - n0 * n0) // 3


def fused_solve_flops(C: int, d_k: int, d_v: int) -> int:
    """[U Y] = P[V̂ ‖ K̂⊙π], a (C×C)(C×(d_v+d_k)) matmul → 2C(d_k + d_v)."""
    return 2 * C * (d_k + d_v)


def leaf_decay_vpu(n0: int, d_k: int) -> int:
    """Leaf 3-D decay tensor n0×n0×d_k on the VPU, 7 ops per entry and channel (sub, exp, ×k_j, ×k̂_i, +,
    ×q̂_i, +), the naive column's per-entry cost → 7·n0·d_k (Muir's Table 8 gives only O(n0 d_k))."""
    return 7 * n0 * d_k


def cross_split_vpu(C: int, n0: int, d_k: int) -> float:
    """Pivot splitting ρ, κ: per level a token is on the R side (sub, exp, ×k̂, ×q̂: 4 ops/channel) or the L side
    (sub, exp, ×k: 3), half the time each → 3.5·r·d_k; r·d_k of them exps."""
    return 3.5 * int(math.log2(C // n0)) * d_k


def naive_decay_vpu(C: int, n0: int, d_k: int) -> int:
    """Naive off-leaf part of the C×C×d_k 3-D decay tensor, 7 ops per entry → 7(C−n0)d_k (Muir, Table 8)."""
    return 7 * (C - n0) * d_k


def forward_substitution_vpu(C: int, d_k: int, d_v: int) -> int:
    """Row-by-row solve T Z = [V̂ ‖ K̂⊙π] on the VPU → C(d_k + d_v), leading term (Muir, Table 8)."""
    return C * (d_k + d_v)


def table8(cfg: KernelConfig) -> dict[str, int]:
    """The four MXU rows of Muir's Table 8 for this config."""
    C, n0, dk, dv = cfg.chunk, cfg.leaf, cfg.d_k, cfg.d_v
    return {"leaf": leaf_inverse_flops(n0), "cross": cross_flops(C, n0, dk),
            "merges": merge_flops(C, n0), "solve": fused_solve_flops(C, dk, dv)}


# ---------------------------------------------------------------------------------------------------------
# Stage lists

def _no_erase_chunk(cfg: KernelConfig, algo: Algo, prefix: str = "") -> list[Stage]:
    """Steps 1-4 without an erase (k̂ = 0): Λ, π, E, the operand scalings and M alone — its leaves (VPU, 5 ops
    per entry and channel: sub, exp, ×k_j, ×q̂_i, +) and its cross blocks (Q̂_R⊙ρ)(K_L⊙κ)ᵀ, half the fused
    [K̂_R⊙ρ; Q̂_R⊙ρ] product (pivots: 3 VPU ops per channel on either side); no T⁻¹, merges or solve (Ũ = V̂)."""
    C, n0, dk, r = cfg.chunk, cfg.leaf, cfg.d_k, cfg.depth
    out = [Stage(prefix + "cumulative log-decay Λ, π, E", cumsum_flops(C, dk), 3 * dk, 2 * dk),
           Stage(prefix + "operand scaling Q̂⊙π, K⊙E", 0, 2 * dk)]
    if algo == "ours":
        return out + [Stage(prefix + "diag. blocks (n0) of M", 0, 5 * n0 * dk, n0 * dk),
                      Stage(prefix + "off-diag. blocks M_cross", cross_flops(C, n0, dk) // 2, 3 * r * dk, r * dk)]
    return out + [Stage(prefix + "diag. blocks (n0) of M", 0, 5 * n0 * dk, n0 * dk),
                  Stage(prefix + "off-diag. blocks M_cross", 0, 5 * (C - n0) * dk, (C - n0) * dk)]


def _decay_and_inverse(cfg: KernelConfig, algo: Algo, prefix: str = "") -> list[Stage]:
    """Steps 1-6 up to Ũ (shared by the forward and the backward's recompute)."""
    if not cfg.has_erase:
        return _no_erase_chunk(cfg, algo, prefix)
    C, n0, dk, dv, r = cfg.chunk, cfg.leaf, cfg.d_k, cfg.d_v, cfg.depth
    out = [
        # π = e^Λ (exp), E = e^{Λ_C−Λ} (sub, exp)
        Stage(prefix + "cumulative log-decay Λ, π, E", cumsum_flops(C, dk), 3 * dk, 2 * dk),
        # K̂⊙π, Q̂⊙π, K⊙E
        Stage(prefix + "operand scaling K̂⊙π, Q̂⊙π, K⊙E", 0, 3 * dk),
    ]
    if algo == "ours":
        out += [
            Stage(prefix + "diag. blocks (n0), T_leaf^-1 (12)", leaf_inverse_flops(n0),
                  leaf_decay_vpu(n0, dk), n0 * dk, table8=not prefix),
            Stage(prefix + "off-diag. blocks (T_cross, M_cross)", cross_flops(C, n0, dk),
                  cross_split_vpu(C, n0, dk), r * dk, table8=not prefix),
            Stage(prefix + "2x2 block-tri. merges (11)", merge_flops(C, n0), 0, table8=not prefix),
            Stage(prefix + "tri. solve T Z = [V̂ ‖ K̂⊙π]", fused_solve_flops(C, dk, dv), 0,
                  table8=not prefix),
        ]
    else:
        out += [
            Stage(prefix + "diag. blocks (n0), T_leaf^-1 (12)", 0, leaf_decay_vpu(n0, dk), n0 * dk,
                  table8=not prefix),
            Stage(prefix + "off-diag. blocks (T_cross, M_cross)", 0, naive_decay_vpu(C, n0, dk),
                  (C - n0) * dk,
                  table8=not prefix),
            Stage(prefix + "2x2 block-tri. merges (11)", 0, 0, table8=not prefix),
            Stage(prefix + "tri. solve T Z = [V̂ ‖ K̂⊙π]", 0,
                  forward_substitution_vpu(C, dk, dv), table8=not prefix),
        ]
    # Ũ = U − Y S₀
    out.append(Stage(prefix + "Ũ = U − Y S₀", 2 * dk * dv, dv))
    return out


def forward_stages(cfg: KernelConfig, algo: Algo = "ours") -> list[Stage]:
    """Forward per chunk: decay, A/M, T⁻¹, solve, Ũ, O = (Q̂⊙π)S₀ + MŨ, S_C update."""
    C, dk, dv = cfg.chunk, cfg.d_k, cfg.d_v
    return _decay_and_inverse(cfg, algo) + [
        Stage("(Q̂⊙π) S₀", 2 * dk * dv, 0),
        Stage("M Ũ (+ add into O)" if cfg.has_erase else "M V̂ (+ add into O)", 2 * C * dv, dv),
        # S_C = Diag(π_C)S₀ + (K⊙E)ᵀŨ: scale + add of a d_k×d_v state once per chunk
        Stage("state update S_C", 2 * dk * dv, 2 * dk * dv / C),
    ]


def backward_stages(cfg: KernelConfig, algo: Algo = "ours") -> list[Stage]:
    """Backward per chunk: recompute steps 1-6 up to Ũ (O and S_C are not needed), then the new
    matmuls. The dA/dM contraction uses the forward's pivoted factors (ours: 4 matmuls per node, 2× the
    forward cross cost, and the same splitting multiplies on the VPU) or the 3-D tensor (naive/leaves: 9 VPU
    ops per entry and channel: dK̂ += dA·w, dQ̂ += dM·w, t = dA·k̂ + dM·q̂, dK += t·e, with w = k·e reused)."""
    C, n0, dk, dv = cfg.chunk, cfg.leaf, cfg.d_k, cfg.d_v
    kv = dk * dv
    out = _decay_and_inverse(cfg, algo, prefix="recompute: ")
    if not cfg.has_erase:  # dV̂ = dŨ, no dY, no transposed solve, no dA: the contractions carry dM alone
        return out + [
            Stage("dV̂ = Mᵀ dO + (K⊙E) dS", 2 * C * dv + 2 * kv, dv),
            Stage("dM = tril(dO V̂ᵀ)", 2 * C * dv, C),
            Stage("dS_prev = (Q̂⊙π)ᵀdO + Diag(π_C)dS", 2 * kv, 2 * kv / C),
            # dQ̂ += dM·w, t = dM·q̂, dK += t·e (w = k·e reused)
            Stage("diag.-block contraction of dM", 0, 5 * n0 * dk),
            Stage("off-diag. contraction of dM", cross_flops(C, n0, dk), 3 * int(math.log2(C // n0)) * dk),
            Stage("G = dO S₀ᵀ, H = V̂ dSᵀ", 4 * kv, 0),
            # dQ̂ (2), dK (3), dΛ (5 products, 4 adds), Σ_i K⊙E⊙H (1) per channel; π_C⊙rowsum(S₀⊙dS)
            Stage("gate gradients dQ̂, dK, dΛ", 0, 15 * dk + 2 * kv / C),
            Stage("dλ = reverse cumsum of dΛ (MXU)", cumsum_flops(C, dk), 0),
        ]
    out += [
        Stage("dŨ = Mᵀ dO + (K⊙E) dS", 2 * C * dv + 2 * kv, dv),
        Stage("dM = tril(dO Ũᵀ)", 2 * C * dv, C),  # C mask selects per token
        Stage("dS_prev = (Q̂⊙π)ᵀdO + Diag(π_C)dS − Yᵀ dŨ", 4 * kv, 3 * kv / C),
        Stage("dY = −dŨ S₀ᵀ", 2 * kv, 0),
    ]
    if algo == "ours":
        out.append(Stage("transposed solve Tᵀ[dV̂ ‖ dR] = [dŨ ‖ dY]", fused_solve_flops(C, dk, dv), 0))
    else:
        out.append(Stage("transposed solve Tᵀ[dV̂ ‖ dR] = [dŨ ‖ dY]", 0, forward_substitution_vpu(C, dk, dv)))
    out.append(Stage("dA = −tril_s([dV̂ ‖ dR][U ‖ Y]ᵀ)", fused_solve_flops(C, dk, dv), C))
    out.append(Stage("diag.-block contraction of dA, dM", 0, 9 * n0 * dk))
    if algo == "ours":
        out.append(Stage("off-diag. contraction of dA, dM", 2 * cross_flops(C, n0, dk),
                         cross_split_vpu(C, n0, dk)))
    else:
        out.append(Stage("off-diag. contraction of dA, dM", 0, 9 * (C - n0) * dk))
    out += [
        Stage("G = dO S₀ᵀ, H = Ũ dSᵀ", 4 * kv, 0),
        # dQ̂ (2), dK̂ (2), dK (3), dΛ (7 products, 6 adds), Σ_i K⊙E⊙H (1) per channel; π_C⊙rowsum(S₀⊙dS)
        Stage("gate gradients dQ̂, dK̂, dK, dΛ", 0, 21 * dk + 2 * kv / C),
        Stage("dλ = reverse cumsum of dΛ (MXU)", cumsum_flops(C, dk), 0),
    ]
    return out


def total(stages: Sequence[Stage], name: str = "total") -> Stage:
    """Sum of stages."""
    return Stage(name, sum(s.mxu for s in stages), sum(s.vpu for s in stages), sum(s.exp for s in stages))


# ---------------------------------------------------------------------------------------------------------
# HBM bytes

def hbm_bytes(cfg: KernelConfig, backward: bool = False) -> dict[str, float]:
    """Bytes per token per head through HBM. Forward: read q̂, k, k̂, v̂ (bf16) and λ (f32), write
    o (bf16) and S₀ of every chunk (f32 d_k·d_v per C tokens). Backward adds: read the inputs again, S₀ and dO,
    write dq̂, dk, dk̂, dv̂ (bf16) and dλ (f32). The per-sequence initial/final state (< C/T of the S₀ term) is
    left out; so is everything outside the kernel (gates, projections)."""
    C, dk, dv, io, g, s = cfg.chunk, cfg.d_k, cfg.d_v, cfg.io_bytes, cfg.gate_bytes, cfg.state_bytes
    inputs = io * ((3 if cfg.has_erase else 2) * dk + dv) + g * dk  # no k̂ (nor dk̂) without an erase
    states = s * dk * dv / C
    out = {"fwd read q̂,k,k̂,v̂,λ": inputs, "fwd write o": io * dv, "fwd write S₀": states}
    if backward:
        out |= {"bwd read q̂,k,k̂,v̂,λ": inputs, "bwd read S₀": states, "bwd read dO": io * dv,
                "bwd write dq̂,dk,dk̂,dv̂,dλ": inputs}
    return out


# ---------------------------------------------------------------------------------------------------------
# Roofline

@dataclasses.dataclass(frozen=True)
class Peak:
    name: str
    flops: float       # dense bf16 matmul FLOP/s
    bandwidth: float   # HBM bytes/s
    source: str


# The roofline's chips (pallas_kernels/chips.py, those with a bandwidth): the measured matmul rate where the
# project measured one (H200), else the datasheet's.
PEAKS: dict[str, Peak] = {
    c.name: Peak(c.name, c.roofline_flops, c.hbm_bandwidth,
                 "measured here: bf16 matmul, device copy" if c.measured_bf16 else c.source)
    for c in chips.CHIPS if c.hbm_bandwidth}


@dataclasses.dataclass(frozen=True)
class Roofline:
    peak: Peak
    t_compute: float
    t_memory: float

    @property
    def time(self) -> float:
        return max(self.t_compute, self.t_memory)

    @property
    def bound(self) -> str:
        return "compute" if self.t_compute >= self.t_memory else "memory"


def roofline(flops: float, nbytes: float, peak: Peak) -> Roofline:
    """max(FLOPs/peak, bytes/bandwidth). All FLOPs (MXU + VPU) are charged at the matmul peak, so this is a
    lower bound: VPU work is slower than that on every chip, which hurts the naive algorithm most."""
    return Roofline(peak, flops / peak.flops, nbytes / peak.bandwidth)


# ---------------------------------------------------------------------------------------------------------
# CLI

def _share(s: Stage) -> str:
    v = s.mxu_share
    return "–" if v is None else f"{100 * v:.1f}%"


def _num(x: float) -> str:
    return f"{x:,.0f}" if abs(x - round(x)) < 1e-9 or abs(x) >= 100 else f"{x:,.1f}"


def _width(text: str) -> int:
    """Display width: combining marks (the hats of K̂, Q̂) take no column."""
    return sum(not unicodedata.combining(ch) for ch in text)


def _stage_table(title: str, ours: list[Stage], naive: list[Stage]) -> list[str]:
    w = max(_width(s.name) for s in ours + naive) + 2
    head = f"{'':{w}}{'ours (boundary-pivoted)':^40}  {'naive chunkwise':^40}"
    cols = f"{'MXU':>11}{'VPU':>10}{'exp':>9}{'share':>8}"
    lines = [f"{title}", head, f"{'stage':{w}}{cols}  {cols}"]
    for a, b in zip(ours + [total(ours)], naive + [total(naive)]):
        assert a.name == b.name, (a.name, b.name)
        cell = lambda s: f"{_num(s.mxu):>11}{_num(s.vpu):>10}{_num(s.exp):>9}{_share(s):>8}"
        pad = " " * (w - 1 - _width(a.name))
        lines.append(f"{'*' if a.table8 else ' '}{a.name}{pad}{cell(a)}  {cell(b)}")
    return lines


def shape_parser(prog: str, description: str, chunk: int, leaf: int) -> argparse.ArgumentParser:
    """The arguments both FLOP CLIs share (this one and pallas_kernels.delta_rule.flops_gpu): kernel tiling and the
    B·T·H workload, with the per-backend chunk and leaf defaults."""
    p = argparse.ArgumentParser(prog=prog, description=description)
    p.add_argument("--chunk", type=int, default=chunk)
    p.add_argument("--leaf", type=int, default=leaf)
    p.add_argument("--dk", type=int, default=128)
    p.add_argument("--dv", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--heads", type=int, default=16)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    p = shape_parser("python -m mixerlab.pallas_kernels.delta_rule.flops", __doc__.split("\n")[0], chunk=256, leaf=8)
    p.add_argument("--backward", action="store_true", help="also count the backward (fwd+bwd totals)")
    p.add_argument("--no-erase", action="store_true", help="the no-erase kernel (k̂ = 0: no T⁻¹, no solve)")
    a = p.parse_args(argv)
    try:
        cfg = KernelConfig(a.chunk, a.leaf, a.dk, a.dv, has_erase=not a.no_erase)
    except ValueError as e:
        p.error(str(e))
    n = a.batch * a.seq * a.heads
    print(f"delta-rule chunk kernel  C={cfg.chunk} n0={cfg.leaf} d_k={cfg.d_k} d_v={cfg.d_v} r={cfg.depth}; "
          f"per token per head; MXU = FLOPs (2/MAC), VPU = ops (exp counted as 1, repeated under 'exp'); "
          f"* = Muir Table 8 row")
    fo, fn = forward_stages(cfg, "ours"), forward_stages(cfg, "naive")
    lines = _stage_table("\nforward", fo, fn)
    ours_all, naive_all = list(fo), list(fn)
    if a.backward:
        bo, bn = backward_stages(cfg, "ours"), backward_stages(cfg, "naive")
        lines += _stage_table("\nbackward", bo, bn)
        ours_all += bo
        naive_all += bn
    print("\n".join(lines))
    t8 = table8(cfg)
    print(f"\nTable 8 MXU rows: leaf {t8['leaf']:,}, cross {t8['cross']:,}, merges {t8['merges']:,}, "
          f"solve {t8['solve']:,}")
    to, tn = total(ours_all), total(naive_all)
    which = "fwd+bwd" if a.backward else "forward"
    print(f"{which} totals: ours {_num(to.mxu + to.vpu)} FLOPs (MXU share {_share(to)}), "
          f"naive {_num(tn.mxu + tn.vpu)} (MXU share {_share(tn)}); VPU naive/ours {tn.vpu / to.vpu:.1f}x, "
          f"total FLOPs ours/naive − 1 = {100 * ((to.mxu + to.vpu) / (tn.mxu + tn.vpu) - 1):+.1f}%")
    nb = hbm_bytes(cfg, a.backward)
    bpt = sum(nb.values())
    print(f"\nHBM bytes per token per head ({which}): {_num(bpt)}  = "
          + " + ".join(f"{k} {_num(v)}" for k, v in nb.items()))
    print(f"\nroofline, B·T·H = {a.batch}·{a.seq}·{a.heads} = {n:,} token-heads, {which}; "
          f"all FLOPs at the bf16 matmul peak (a lower bound)")
    print(f"{'chip':6}{'TFLOP/s':>9}{'TB/s':>7}{'ours ms':>10}{'bound':>9}{'naive ms':>10}{'bound':>9}   source")
    for pk in PEAKS.values():
        ro = roofline(n * (to.mxu + to.vpu), n * bpt, pk)
        rn = roofline(n * (tn.mxu + tn.vpu), n * bpt, pk)
        print(f"{pk.name:6}{pk.flops / 1e12:>9.0f}{pk.bandwidth / 1e12:>7.2f}{1e3 * ro.time:>10.3f}{ro.bound:>9}"
              f"{1e3 * rn.time:>10.3f}{rn.bound:>9}   {pk.source}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
