"""The xla interdomain/S4D ops' matmul precision: 16-bit callers get DEFAULT on the data contractions (on a
GPU: tensor-core TF32 instead of float32 on the CUDA cores), float32 callers keep HIGHEST everywhere, and the
range sums of the log-modulus (they become exponents) are HIGHEST for every caller."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mixerlab.pallas_kernels.interdomain import api as ia

from .interdomain_cases import _inputs

B, T, H, R, DV, M = 1, 24, 2, 8, 8, 4


def _dot_precisions(fn, *args):
    """(DEFAULT count, HIGHEST count) over every dot_general of fn's jaxpr, nested jaxprs included."""
    counts = {"DEFAULT": 0, "HIGHEST": 0}

    def visit(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "dot_general":
                precision = eqn.params["precision"]
                first = precision[0] if isinstance(precision, tuple) else precision
                counts["HIGHEST" if first == jax.lax.Precision.HIGHEST else "DEFAULT"] += 1
            for sub in jax.core.jaxprs_in_params(eqn.params):
                visit(sub)

    visit(jax.make_jaxpr(fn)(*args).jaxpr)
    return counts["DEFAULT"], counts["HIGHEST"]


def _ia(dtype):
    xs, document = _inputs(0, B, T, H, R, DV, M, boundaries=(9,))
    q, k, v = (jnp.asarray(x, dtype) for x in xs[:3])
    params = [jnp.asarray(x, jnp.float32) for x in xs[3:7]]

    def fn(q, k, v):
        o, _ = ia.interdomain(q, k, v, log_modulus=params[0], phase=params[1], input_gain=params[2],
                              readout=params[3], segment_ids=document, chunk_size=16, sub_chunk_size=8,
                              implementation="xla")
        return o

    return fn, (q, k, v)


@pytest.mark.parametrize("dtype,expect_default", [(jnp.bfloat16, True), (jnp.float32, False)])
def test_interdomain_xla_data_matmuls_follow_the_input_dtype(dtype, expect_default):
    fn, args = _ia(dtype)
    n_default, n_highest = _dot_precisions(fn, *args)
    assert n_highest > 0  # the range sums of r stay HIGHEST for every caller
    assert (n_default > 0) == expect_default, (n_default, n_highest)
    grads = jax.grad(lambda *a: jnp.sum(fn(*a).astype(jnp.float32)), argnums=(0, 1, 2))(*args)
    assert all(np.isfinite(np.asarray(g, np.float32)).all() for g in grads)


def test_s4d_xla_bf16_inputs_take_default_data_matmuls_and_match_float32():
    xs, document = _inputs(1, B, T, H, R, DV, M)
    z = np.asarray(xs[2])
    params = dict(log_modulus=jnp.asarray(xs[3], jnp.float32), phase=jnp.asarray(xs[4], jnp.float32),
                  input_gain=jnp.asarray(xs[5], jnp.float32),
                  readout=jnp.asarray(np.asarray(xs[6])[:, 0], jnp.float32))

    def fn(z):
        return ia.s4d(z, **params, segment_ids=document, chunk_size=16, sub_chunk_size=8, implementation="xla")[0]

    z16 = jnp.asarray(z, jnp.bfloat16)
    n_default, _ = _dot_precisions(fn, z16)
    assert n_default > 0
    # the same bf16-rounded input through the float32 path: on the CPU DEFAULT is full float32 too, so the two
    # agree to float32 rounding (the GPU's TF32 difference is checked by the GPU tests' bf16 tolerances)
    o16 = np.asarray(fn(z16), np.float32)
    o32 = np.asarray(fn(z16.astype(jnp.float32)), np.float32)
    np.testing.assert_allclose(o16, o32, rtol=2e-2, atol=2e-2)
