"""Dense causal attention over packed documents, computed in the compute dtype (float64 under x64): the oracle
the kernels are tested against. Materialises the [B, H, T, T] scores: tests and short sequences only."""
from __future__ import annotations

import jax
import jax.numpy as jnp


def document_mask(document_BT):
    """[B, 1, T, T] bool: query i may read key j iff j ≤ i and both lie in the same document."""
    t = document_BT.shape[1]
    same = document_BT[:, :, None] == document_BT[:, None, :]
    return (same & jnp.tril(jnp.ones((t, t), bool)))[:, None]


def attention_reference(q_BTHD, k_BTHD, v_BTHD, document_BT, scale):
    scores = jnp.einsum("bqhd,bkhd->bhqk", q_BTHD, k_BTHD, precision=jax.lax.Precision.HIGHEST) * scale
    scores = jnp.where(document_mask(document_BT), scores, -jnp.inf)
    weights = jax.nn.softmax(scores, axis=-1)  # the diagonal is always kept, so no row is all -inf
    return jnp.einsum("bhqk,bkhd->bqhd", weights, v_BTHD, precision=jax.lax.Precision.HIGHEST)
