"""Cholesky factorisation and lower-triangular solve of small batched matrices (the VLA chunk's c×c Gram).

On CPU these are plain loops of vectorised jnp ops instead of jaxlib's LAPACK custom calls: jaxlib's CPU
Cholesky splits its batch over XLA's intra-op thread pool and waits for the pieces from inside that pool, so
two Cholesky calls that XLA runs at the same time can hold every worker of a small pool and wait forever (seen
as a training step that never returns on the 2-core CI machine: gdb showed both Eigen workers blocked in
``jax::ParallelBatchMap`` under ``lapack_spotrf_ffi``). Other backends keep the native ops
(``lax.platform_dependent`` picks by the platform the program is lowered for). c ≤ 64 here, so c loop
iterations of O(c²) vector work cost little; autodiff goes through the loops.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.scipy.linalg import solve_triangular

_HIGHEST = jax.lax.Precision.HIGHEST


def _cholesky_loop(a):
    """Lower L with L Lᵀ = a, column by column (Cholesky–Crout). a [..., n, n] symmetric positive definite;
    like LAPACK, a matrix that is not positive definite gives NaNs."""
    n = a.shape[-1]
    index = jnp.arange(n)

    def column(j, low):
        done = (index < j).astype(a.dtype)  # columns already computed
        row_j = jnp.take(low, j, axis=-2) * done  # L[j, :j]
        s = jnp.take(a, j, axis=-1) - jnp.einsum("...ik,...k->...i", low * done, row_j, precision=_HIGHEST)
        pivot = jnp.sqrt(jnp.take(s, j, axis=-1))[..., None]
        new = jnp.where(index > j, s / pivot, jnp.where(index == j, pivot, 0.0))
        return jax.lax.dynamic_update_index_in_dim(low, new[..., None], j, axis=-1)

    return jax.lax.fori_loop(0, n, column, jnp.zeros_like(a))


def _solve_lower_loop(low, b):
    """x with low · x = b by forward substitution. low [..., n, n] lower triangular, b [..., n, m]."""
    n = low.shape[-1]
    index = jnp.arange(n)

    def row(i, x):
        row_i = jnp.take(low, i, axis=-2)  # L[i, :]
        below = row_i * (index < i).astype(low.dtype)  # L[i, :i]
        rhs = jnp.take(b, i, axis=-2) - jnp.einsum("...k,...km->...m", below, x, precision=_HIGHEST)
        x_i = rhs / jnp.take(row_i, i, axis=-1)[..., None]
        return jax.lax.dynamic_update_index_in_dim(x, x_i, i, axis=-2)

    return jax.lax.fori_loop(0, n, row, jnp.zeros_like(b))


def cholesky(a):
    """Lower Cholesky factor of a [..., n, n]; loops on CPU, ``jnp.linalg.cholesky`` elsewhere."""
    return jax.lax.platform_dependent(a, cpu=_cholesky_loop, default=jnp.linalg.cholesky)


def solve_lower(low, b):
    """low⁻¹ b for lower-triangular low [..., n, n] and b [..., n, m]; loops on CPU, ``solve_triangular``
    elsewhere."""
    return jax.lax.platform_dependent(low, b, cpu=_solve_lower_loop,
                                      default=lambda l_, b_: solve_triangular(l_, b_, lower=True))
