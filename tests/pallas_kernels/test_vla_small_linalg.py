"""The loop Cholesky / forward substitution used by the VLA chunk on CPU (pallas_kernels/vla/small_linalg.py)
against LAPACK, values and gradients, float64 and float32."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.scipy.linalg import solve_triangular

from mixerlab.pallas_kernels.vla import small_linalg


def _spd(key, shape, n, dtype):
    x = jax.random.normal(key, (*shape, n, n), dtype)
    return jnp.eye(n, dtype=dtype) + x @ jnp.swapaxes(x, -1, -2) / n


@pytest.mark.parametrize("dtype,tol", [(jnp.float64, 1e-12), (jnp.float32, 2e-5)])
@pytest.mark.parametrize("n", [1, 5, 20])
def test_loops_match_lapack(dtype, tol, n):
    with jax.enable_x64(dtype == jnp.float64):
        a = _spd(jax.random.PRNGKey(n), (2, 3), n, dtype)
        b = jax.random.normal(jax.random.PRNGKey(7), (2, 3, n, 4), dtype)
        cholesky_loop, solve_loop = jax.jit(small_linalg._cholesky_loop), jax.jit(small_linalg._solve_lower_loop)
        low = cholesky_loop(a)
        np.testing.assert_allclose(low, jnp.linalg.cholesky(a), rtol=tol, atol=tol)
        assert np.all(np.triu(np.asarray(low), 1) == 0)
        np.testing.assert_allclose(solve_loop(low, b), solve_triangular(low, b, lower=True),
                                   rtol=tol, atol=tol)
        # the public entry points take the loops on CPU
        np.testing.assert_allclose(jax.jit(small_linalg.cholesky)(a), low, rtol=tol, atol=tol)
        np.testing.assert_allclose(jax.jit(small_linalg.solve_lower)(low, b), solve_loop(low, b),
                                   rtol=tol, atol=tol)


def test_gradients_match_lapack():
    with jax.enable_x64(True):
        a = _spd(jax.random.PRNGKey(3), (2,), 6, jnp.float64)
        b = jax.random.normal(jax.random.PRNGKey(4), (2, 6, 3), jnp.float64)
        w = jax.random.normal(jax.random.PRNGKey(5), (2, 6, 3), jnp.float64)

        def loss(chol, solve):  # through a symmetric input, as in the VLA chunk (I + (M + Mᵀ)/2): LAPACK's
            # derivative is the symmetrised one, the loop's reads the lower triangle; they agree on symmetric inputs
            return lambda a_, b_: jnp.sum(w * solve(chol(0.5 * (a_ + jnp.swapaxes(a_, -1, -2))), b_))

        ours = jax.jit(jax.grad(loss(small_linalg.cholesky, small_linalg.solve_lower), argnums=(0, 1)))(a, b)
        lapack = jax.jit(jax.grad(loss(jnp.linalg.cholesky, lambda l_, b_: solve_triangular(l_, b_, lower=True)),
                                  argnums=(0, 1)))(a, b)
        for x, y in zip(ours, lapack):
            np.testing.assert_allclose(x, y, rtol=1e-10, atol=1e-12)


def test_not_positive_definite_gives_nan_like_lapack():
    a = jnp.array([[1.0, 2.0], [2.0, 1.0]])
    assert np.isnan(np.asarray(small_linalg._cholesky_loop(a))).any()
