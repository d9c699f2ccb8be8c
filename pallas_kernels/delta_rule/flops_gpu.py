"""Executed tensor-core FLOPs and HBM bytes of the GPU (Pallas → Triton) delta-rule kernels, per kernel, and
the roofline time each would have on the H200 — to set the measured times of
``tools/bench_delta_rule_gpu.py`` against (no JAX needed).

Unlike ``pallas_kernels.delta_rule.flops`` (the ideal fused TPU kernel, Muir's Table 8), this counts what the
kernels of ``pallas_kernels/delta_rule/pallas_triton.py`` (bodies in ``pallas_triton_kernels.py``) execute:
  * every matmul over its full tiles (the masked C×C pivot-level products count in full: they are computed
    in full and masked afterwards);
  * decay sums (0/1 matrix × λ) and the inverse run on TF32 tensor cores, charged at half the bf16 rate
    (the datasheet's TF32 : bf16 ratio; not measured here); every other matmul is bf16;
  * bytes: every HBM read and write of each kernel, in the operand dtype (bf16 by default) for the inputs
    and the matmul intermediates (M, P, U, Y, Q̂⊙π, K⊙E, Ũ, dŨ, dM, dA, S₀, dS_C), f32 for λ, dλ and π_C;
    the key-gradient kernel reads its per-chunk operands once per key block, and K1 writes K̂⊙π to Y's
    block and reads it back (upper bounds: L2 absorbs part of it);
  * exps (``kernel_exps``); other elementwise work (masks, products) is not counted;
  * ``bounded=True`` (the kernels' default, ``bounded_span``): the path every key block takes when its
    gates keep each half-chunk's decay within e^{−span} — one check, one factored product per matrix and
    no exact pivot level; a key block that fails the check runs up to ``levels`` exact levels more (the
    counts of ``bounded=False``). The declared estimate is this common path.
The Triton kernels declare these counts as their ``pl.CostEstimate``.

    python -m mixerlab.pallas_kernels.delta_rule.flops_gpu [--chunk 64 --leaf 16 --dk 128 --dv 128 --block-k 32]
        [--measured docs/benchmarks/raw/delta_rule_h200_2026-11-30.json] [--no-erase]
"""
from __future__ import annotations

import json
import math
import sys
from typing import Sequence

from mixerlab.pallas_kernels import chips
from mixerlab.pallas_kernels.delta_rule.flops import shape_parser

# run only in a forward without backward: K2_scan_output in place of K2_scan + K3_output, K1_intra_alone (with
# fold_solve) in place of K1_intra
FORWARD_ALONE = ("K1_intra_alone", "K2_scan_output")
BF16_FLOPS = chips.by_name("H200").measured_bf16  # a large bf16 matmul measured on the H200; TF32 at half of it
HBM_BYTES_S = chips.by_name("H200").hbm_bandwidth  # measured device copy on the H200


def kernel_counts(chunk=64, leaf=16, dk=128, dv=128, block_k=32, sum_passes=1, save_matrices=True,
                  operand_bytes=2, bounded=True, save_rhs=True, fuse_output=True, end_difference=False,
                  fold_solve=True, two_pass=True, has_erase=True):
    """{kernel: (bf16 FLOPs, tf32 FLOPs, HBM bytes)} per chunk of one head. ``sum_passes``: 1 for
    decay_sums="tf32" (bf16 inputs), 2 for "tf32x2". ``operand_bytes``: 2 for bf16/f16 inputs, 4 for f32
    (then the "bf16" FLOPs run as f32 matmuls; the inputs, matmul intermediates and states scale with it).
    ``bounded``: the factored path (one pair product per matrix, one decay sum for the factors) instead of
    the exact tree (one of each per level). ``save_rhs`` (with ``save_matrices``): the backward keeps K1's
    U, Y, Q̂⊙π, K⊙E, π_C and runs no B0. ``fuse_output``: a forward without backward runs K2_scan_output (K2
    and K3 in one kernel; S₀ and Ũ never reach HBM) instead of K2_scan and K3_output — listed as well, outside
    the training kernels (:data:`FORWARD_ALONE`). ``end_difference``: E's exponent as the chunk total minus
    π's (the kernels' ``end_decays="difference"``, one decay sum for both chunk edges instead of two).
    ``fold_solve`` (with ``fuse_output``): the forward alone runs K1_intra_alone, which writes M P, K̂⊙π, Q̂⊙π,
    Pᵀ(K⊙E), π_C (reads no V̂; K⊙E makes the round trip K̂⊙π makes in K1), and K2_scan_output reads V̂ in
    place of U (the same count). ``two_pass`` (with ``bounded``): B2b takes the forward's flags and runs no check
    of its own (the whole-chunk pass; K1's first pass keeps its check, the search passes declare nothing).
    ``has_erase=False``: the kernels specialised to no erase (:func:`plain_kernel_counts`)."""
    if not has_erase:
        return plain_kernel_counts(chunk, dk, dv, block_k, sum_passes, save_matrices, operand_bytes, bounded,
                                   fuse_output, end_difference, two_pass)
    c, ob = chunk, operand_bytes
    edges = 1 if end_difference else 2  # decay sums for π and E
    pair_passes = 1 if bounded else int(math.log2(chunk))  # pair products per matrix = decay sums for them
    mm = lambda m, k, n: 2 * m * k * n  # noqa: E731
    sums = lambda count: count * sum_passes * mm(c, c, dk)  # noqa: E731  (count decay-sum matmuls over all keys)
    inputs = c * (ob * (3 * dk + dv) + 4 * dk) + 4 * c  # q̂, k, k̂, v̂ (operand dtype), λ (f32), documents
    tile = lambda width: ob * c * width  # noqa: E731  an operand-dtype [C, width] tile
    state = ob * dk * dv  # S₀ / dS_C per chunk, operand dtype
    n_inverse = 2 * (int(math.log2(leaf)) - 1) + 2 * (int(math.log2(chunk)) - int(math.log2(leaf)))
    rhs_out = tile(dv) + 3 * tile(dk) + 4 * dk  # U, Y, Q̂⊙π, K⊙E, π_C
    out = {
        "K1_intra": (pair_passes * 2 * mm(c, dk, c) + mm(c, c, dv) + mm(c, c, dk),
                     sums(pair_passes + edges) + n_inverse * mm(c, c, c),
                     inputs + tile(c) * (2 if save_matrices else 1) + rhs_out + 2 * tile(dk)),  # + K̂⊙π stashed
        "K2_scan": (2 * mm(c, dk, dv), 0, tile(dv) + 2 * tile(dk) + 4 * dk + state + tile(dv)),
        "K3_output": (mm(c, dk, dv) + mm(c, c, dv), 0, tile(dk) + state + tile(c) + 2 * tile(dv)),
    }
    if fuse_output and fold_solve:
        out["K1_intra_alone"] = (pair_passes * 2 * mm(c, dk, c) + mm(c, c, c) + mm(c, c, dk), out["K1_intra"][1],
                                 inputs - ob * c * dv + tile(c) + 3 * tile(dk) + 4 * dk + 2 * tile(dk))
    if fuse_output:  # reads U (V̂ with fold_solve), Y (K̂⊙π), K⊙E (Pᵀ(K⊙E)), π_C, Q̂⊙π, M (M P); writes O
        out["K2_scan_output"] = (3 * mm(c, dk, dv) + mm(c, c, dv), 0,
                                 tile(dv) + 3 * tile(dk) + 4 * dk + tile(c) + tile(dv))
    if save_matrices and not save_rhs:
        out["B0_rhs"] = (mm(c, c, dv) + mm(c, c, dk), sums(edges), inputs + tile(c) + rhs_out)
    elif not save_matrices:
        out["B0_intra_again"] = (out["K1_intra"][0], out["K1_intra"][1], out["K1_intra"][2] + tile(c))
    nkb = dk // block_k
    out |= {
        "B1_scan_bwd": (mm(c, c, dv) + 3 * mm(c, dk, dv), 0,
                        tile(c) + 3 * tile(dk) + 4 * dk + tile(dv) + state + tile(dv)),
        "B2a_cotangents": (3 * mm(c, c, dv) + mm(c, dk, dv) + mm(c, dv, dk) + 2 * mm(c, c, dk), 0,
                           4 * c + tile(c) + tile(dv) + tile(dk) + state + 2 * tile(dv)
                           + tile(dv) + 2 * tile(c) + tile(dv)),
        "B2b_key_grads": (3 * mm(c, dv, dk) + mm(c, c, dk) + pair_passes * 4 * mm(c, c, dk),
                          sums(pair_passes + edges + (1 if bounded and not two_pass else 0)),  # the check, again
                          inputs - c * ob * dv + 2 * state
                          + nkb * (tile(c) + 3 * tile(dv) + 2 * tile(c)) + c * (ob * 3 * dk + 4 * dk)),
    }
    return out


def plain_kernel_counts(chunk=64, dk=128, dv=128, block_k=32, sum_passes=1, save_matrices=True, operand_bytes=2,
                        bounded=True, fuse_output=True, end_difference=False, two_pass=True):
    """:func:`kernel_counts` of the kernels without an erase (``Config.has_erase=False``): no A, no inverse,
    no U, Y or Ũ. K1 writes M, Q̂⊙π, K⊙E, π_C (M only of the pair products; decay sums as with an erase); K2
    reads V̂ in place of U and Ũ, K3 reads V̂ in place of Ũ; B1 writes dV̂ (= dŨ) itself; B2a is dM = dO V̂ᵀ
    alone; B2b has no dk̂, dA or dR = Pᵀ dY terms. No ``K1_intra_alone`` (the forward alone runs K1_intra:
    there is no solve to fold), no ``B0_rhs`` (the backward keeps every K1 tile, or runs K1 again)."""
    c, ob = chunk, operand_bytes
    edges = 1 if end_difference else 2
    pair_passes = 1 if bounded else int(math.log2(chunk))
    mm = lambda m, k, n: 2 * m * k * n  # noqa: E731
    sums = lambda count: count * sum_passes * mm(c, c, dk)  # noqa: E731
    inputs = c * (ob * 2 * dk + 4 * dk) + 4 * c  # q̂, k (operand dtype), λ (f32), documents
    tile = lambda width: ob * c * width  # noqa: E731
    state = ob * dk * dv
    out = {
        "K1_intra": (pair_passes * mm(c, dk, c), sums(pair_passes + edges), inputs + tile(c) + 2 * tile(dk) + 4 * dk),
        "K2_scan": (mm(c, dk, dv), 0, tile(dv) + tile(dk) + 4 * dk + state),  # reads V̂, K⊙E, π_C; writes S₀
        "K3_output": (mm(c, dk, dv) + mm(c, c, dv), 0, tile(dk) + state + tile(c) + 2 * tile(dv)),
    }
    if fuse_output:  # reads V̂, K⊙E, π_C, Q̂⊙π, M; writes O
        out["K2_scan_output"] = (2 * mm(c, dk, dv) + mm(c, c, dv), 0, 2 * tile(dv) + 2 * tile(dk) + 4 * dk + tile(c))
    if not save_matrices:
        out["B0_intra_again"] = out["K1_intra"]
    nkb = dk // block_k
    out |= {
        # reads M, dO, K⊙E, Q̂⊙π, π_C; writes dS_C, dV̂
        "B1_scan_bwd": (mm(c, c, dv) + 2 * mm(c, dk, dv), 0, tile(c) + 2 * tile(dk) + 4 * dk + tile(dv) + state
                        + tile(dv)),
        "B2a_cotangents": (mm(c, dv, c), 0, 4 * c + 2 * tile(dv) + tile(c)),  # reads V̂, dO; writes dM
        # dO S₀ᵀ, V̂ dSᵀ and the pair products of dM; per key block it reads dO, V̂ and dM again
        "B2b_key_grads": (2 * mm(c, dv, dk) + pair_passes * 2 * mm(c, c, dk),
                          sums(pair_passes + edges + (1 if bounded and not two_pass else 0)),
                          inputs + 2 * state + nkb * (2 * tile(dv) + tile(c)) + c * (ob * 2 * dk + 4 * dk)),
    }
    return out


def kernel_exps(chunk=64, dk=128, save_matrices=True, bounded=True, save_rhs=True, fuse_output=True, has_erase=True):
    """{kernel: exponentials} per chunk of one head: one [C, Dk] e^{W λ} per decay-sum matmul (π, E, each
    pivot level) and π_C [Dk]; the other kernels take none. ``bounded``: two [C, Dk]
    factors (e^{±x}) instead of one per level. ``has_erase=False``: the same exps (the factors feed M), no
    K1_intra_alone or B0_rhs."""
    c, pair_exps = chunk, (2 if bounded else int(math.log2(chunk)))
    k1 = (pair_exps + 2) * c * dk + dk
    out = {"K1_intra": k1, "K2_scan": 0, "K3_output": 0,
           **({"K1_intra_alone": k1, "K2_scan_output": 0} if fuse_output else {})}
    if not has_erase:
        out.pop("K1_intra_alone", None)
    if save_matrices and not save_rhs and has_erase:
        out["B0_rhs"] = 2 * c * dk + dk
    elif not save_matrices:
        out["B0_intra_again"] = k1
    out |= {"B1_scan_bwd": 0, "B2a_cotangents": 0, "B2b_key_grads": (pair_exps + 2) * c * dk + dk}
    return out


def roofline_ms(counts, token_heads, chunk):
    """{kernel: (ms at the FLOP roof, ms at the byte roof)} for ``token_heads`` tokens × heads."""
    chunks = token_heads / chunk
    return {name: (1e3 * chunks * (bf + 2 * tf) / BF16_FLOPS, 1e3 * chunks * nbytes / HBM_BYTES_S)
            for name, (bf, tf, nbytes) in counts.items()}


def main(argv: Sequence[str] | None = None) -> int:
    p = shape_parser("python -m mixerlab.pallas_kernels.delta_rule.flops_gpu", __doc__.split("\n")[0],
                     chunk=64, leaf=16)
    p.add_argument("--block-k", type=int, default=32)
    p.add_argument("--sum-passes", type=int, default=1, choices=(1, 2))
    p.add_argument("--no-save-rhs", action="store_true", help="count B0 (save_rhs=False)")
    p.add_argument("--no-fuse-output", action="store_true", help="count K2 and K3 apart (fuse_output=False)")
    p.add_argument("--no-erase", action="store_true", help="the no-erase kernels (erase_key=None: no A, no solve)")
    p.add_argument("--measured", help="bench JSON of tools/bench_delta_rule_gpu.py (per-kernel breakdown)")
    a = p.parse_args(argv)
    counts = kernel_counts(a.chunk, a.leaf, a.dk, a.dv, a.block_k, a.sum_passes, save_rhs=not a.no_save_rhs,
                           fuse_output=not a.no_fuse_output, has_erase=not a.no_erase)
    n = a.batch * a.seq * a.heads
    roof = roofline_ms(counts, n, a.chunk)
    measured = {}
    if a.measured:
        with open(a.measured) as f:
            timings = json.load(f)["timings"]
        key = f"{a.batch}x{a.seq}"
        try:
            measured = {k: v[0] for k, v in timings[key]["ours"]["breakdown"].items()}
        except (KeyError, TypeError):
            p.error(f"{a.measured}: no per-kernel breakdown for shape {key} (timings.{key}.ours.breakdown)")
    variant = " without an erase" if a.no_erase else ""
    print(f"GPU delta-rule kernels{variant},"
          f" C={a.chunk} leaf={a.leaf} d_k={a.dk} d_v={a.dv} block_k={a.block_k}, "
          f"B·T·H = {a.batch}·{a.seq}·{a.heads}; H200 roofs {BF16_FLOPS / 1e12:.0f} TFLOP/s bf16 (TF32 at half), "
          f"{HBM_BYTES_S / 1e12:.1f} TB/s")
    print("| kernel | GFLOP bf16 | GFLOP tf32 | GB | roof ms (FLOPs) | roof ms (bytes) | measured ms "
          "| measured / roof |")
    print("|---|---|---|---|---|---|---|---|")
    tot = [0.0] * 6
    chunks = n / a.chunk
    for name, (bf, tf, nb) in counts.items():
        t_f, t_b = roof[name]
        got = measured.get(name)
        ratio = f"{got / max(t_f, t_b):.1f}×" if got else "—"
        print(f"| {name} | {chunks * bf / 1e9:.1f} | {chunks * tf / 1e9:.1f} | {chunks * nb / 1e9:.2f} | "
              f"{t_f:.3f} | {t_b:.3f} | {got if got is None else f'{got:.3f}'} | {ratio} |".replace("| None |",
                                                                                                    "| — |"))
        if name in FORWARD_ALONE:  # not part of a training step's kernels
            continue
        for i, x in enumerate((chunks * bf / 1e9, chunks * tf / 1e9, chunks * nb / 1e9, t_f, t_b, got or 0.0)):
            tot[i] += x
    print(f"| total (forward + backward) | {tot[0]:.1f} | {tot[1]:.1f} | {tot[2]:.2f} | {tot[3]:.3f} | {tot[4]:.3f} | "
          f"{tot[5]:.3f} | {tot[5] / max(tot[3], tot[4]):.1f}× |" if measured else
          f"| total (forward + backward) | {tot[0]:.1f} | {tot[1]:.1f} | {tot[2]:.2f} | {tot[3]:.3f} | "
          f"{tot[4]:.3f} | — | — |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
