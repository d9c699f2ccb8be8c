"""What the Pallas A-pass kernels of VLA share across backends (``pallas_triton.py``, ``pallas_tpu.py``): the
per-token flag encoding and the custom VJP around a forward/backward kernel pair.

Both backends run the token-level Sherman–Morrison pass with the same residuals — the write directions g, the
per-token update factors, and A at the start of every saved block ("anchors") — so the VJP is one piece: the
forward keeps those residuals, the backward symmetrises the cotangents of the symmetric matrices (A₀ and the final
A are symmetric, so only their symmetric parts are defined)."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from mixerlab.pallas_kernels import common

F32 = jnp.float32
RESET, REFRESH = 1, 2  # bits of the per-token flags: document starts at t (t > 0); refresh after t


def token_flags(document_BT, refresh_BT):
    """[B, T] int32: RESET where a document starts at t > 0 (A ← I/λ₀ before the token), REFRESH where
    A ← A + ρI after it."""
    starts = jnp.concatenate([jnp.zeros_like(document_BT[:, :1], dtype=bool),
                              document_BT[:, 1:] != document_BT[:, :-1]], axis=1)
    return starts.astype(jnp.int32) * RESET + refresh_BT.astype(jnp.int32) * REFRESH


def _symmetric(x):
    return 0.5 * (x + jnp.swapaxes(x, -1, -2))


def penalty_pass_with_vjp(forward, backward):
    """The differentiable pass ``(cfg, k̂, u, A₀, flags) -> (g, A_final)`` from a kernel pair:
    ``forward(cfg, k̂, u, A₀, flags) -> (g, factors, anchors, A_final)`` and
    ``backward(cfg, k̂, u, factors, flags, dg, anchors, dA_final) -> (dk̂, du, dA₀)``. Gradients w.r.t. k̂, u and
    A₀ (the flags are integers)."""

    @functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
    def penalty_pass(cfg, k_hat, u, a0, flags):
        g, _, _, a_final = forward(cfg, k_hat, u, a0, flags)
        return g, a_final

    def fwd(cfg, k_hat, u, a0, flags):
        g, factors, anchors, a_final = forward(cfg, k_hat, u, a0, flags)
        g, a_final, factors, anchors = common.keep_for_backward((g, a_final, factors, anchors))
        return (g, a_final), (k_hat, u, flags, factors, anchors)

    def bwd(cfg, residuals, cotangents):
        k_hat, u, flags, factors, anchors = residuals
        d_g, d_final = cotangents
        # the kernels carry a symmetric Ā (up to the rounding of fused multiply-adds)
        dk, du, d_a0 = backward(cfg, k_hat, u, factors, flags, d_g.astype(F32), anchors,
                                _symmetric(d_final.astype(F32)))
        return dk, du, _symmetric(d_a0), None

    penalty_pass.defvjp(fwd, bwd)
    return penalty_pass
