"""Model FLOPs of the chunked DPLR delta rule (docs/math/dplr_delta_rule.md, 'Chunk form'), per head.

The essential multiply-adds of one chunk of C tokens (d_k = K, d_v = V), as the algorithm needs them: the
pair matrices on and below the diagonal only, the unit-triangular system solved by substitution. The pure-JAX
form (xla.py) spends more than this (full C×C blocks, a doubling inverse, the exact decay tensor of a
leaf): like the delta-rule count, the model count is fixed by the algorithm and the config, not by the code
that happens to run it, so a leaner implementation shows a higher MFU.

    A_αβ, A_αk  (pairs j < i)      2 · C(C−1)/2 · K      A_qβ, A_qk (pairs j ≤ i)   2 · C(C+1)/2 · K
    A_αk V                         C(C−1)/2 · V          (I − A_αβ)⁻¹ [α⊙Γ⁻ | A_αk V]   C(C−1)/2 · (K + V)
    Q_eff = A_qβ W (+ q⊙Γ)         C(C+1)/2 · K          O_intra = A_qβ U + A_qk V   2 · C(C+1)/2 · V
    F = (β⊙E)ᵀ W                   C · K · K             G = (β⊙E)ᵀ U + (k⊙E)ᵀ V     2 · C · K · V
    S ← F S + G                    K · K · V             O = Q_eff S₀                C · K · V
Training = 3 × forward (each matmul's backward is two matmuls of its size); 2 FLOPs per multiply-add.
"""
from __future__ import annotations


def forward_macs_per_chunk(chunk: int, d_k: int, d_v: int) -> int:
    c, k, v = chunk, d_k, d_v
    below, lower = c * (c - 1) // 2, c * (c + 1) // 2
    pairs = 2 * below * k + 2 * lower * k
    solve = below * v + below * (k + v)
    outputs = lower * k + 2 * lower * v + c * k * v
    state = c * k * k + 2 * c * k * v + k * k * v
    return pairs + solve + outputs + state


def training_flops_per_token(chunk: int, d_k: int, d_v: int) -> float:
    """Forward + backward FLOPs per token and head."""
    return 3.0 * 2.0 * forward_macs_per_chunk(chunk, d_k, d_v) / chunk
