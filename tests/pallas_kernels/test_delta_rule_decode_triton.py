"""The Pallas-Triton decode step against the float64 token-by-token reference.

CPU: interpret mode (several head dims, bf16 and f32 inputs, a 24-token decode loop with packed-document style
state resets by the caller). GPU (``-m gpu``, skipped elsewhere): the compiled kernel, and ``auto`` choosing it.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from delta_rule_cases import gdn2_inputs, rel_rms_err, x64
from mixerlab.pallas_kernels import delta_rule_step
from mixerlab.pallas_kernels.delta_rule import api, decode_pallas_triton, reference


def _loop(inputs, steps, run):
    state, outs = inputs["initial_state"], []
    for t in range(steps):
        out, state = run(inputs["q"][:, t], inputs["k"][:, t], inputs["erase_key"][:, t], inputs["v"][:, t],
                         inputs["log_decay"][:, t], state)
        outs.append(out)
    return jnp.stack(outs, axis=1), state


def _reference(inputs, steps):
    with x64():
        wide = {n: jnp.asarray(x, jnp.float64) for n, x in inputs.items()}
        doc = jnp.zeros(wide["q"].shape[:2], jnp.int32)[:, :steps]
        cut = {n: x if n == "initial_state" else x[:, :steps] for n, x in wide.items()}
        out, state = reference.delta_rule_reference(cut["q"], cut["k"], cut["erase_key"], cut["v"], cut["log_decay"],
                                                    cut["initial_state"], doc)
        return np.asarray(out), np.asarray(state)


@pytest.mark.parametrize("dtype, key_dim, value_dim, tol", [
    (jnp.float32, 32, 16, 2e-6),
    (jnp.float32, 16, 64, 2e-6),   # two value blocks
    (jnp.bfloat16, 64, 32, 1e-2),  # bf16 inputs (the reference sees the same rounded inputs), f32 state
])
def test_interpret_decode_loop_matches_reference(dtype, key_dim, value_dim, tol):
    steps = 24
    inputs = gdn2_inputs(3, 2, steps, 2, key_dim, value_dim, dtype=np.float32)
    cast = {n: jnp.asarray(x, jnp.float32 if n in ("log_decay", "initial_state") else dtype)
            for n, x in inputs.items()}
    step = jax.jit(lambda q, k, e, v, lam, s: decode_pallas_triton.step(q, k, e, v, lam, s, interpret=True))
    out, state = _loop(cast, steps, step)
    assert out.dtype == dtype and state.dtype == jnp.float32
    rounded = {n: np.asarray(jnp.asarray(x, jnp.float32)) for n, x in cast.items()}
    ref_out, ref_state = _reference(rounded, steps)
    assert rel_rms_err(out, ref_out) <= tol
    assert rel_rms_err(state, ref_state) <= tol


def test_dispatch_on_cpu_uses_xla_and_names_the_reason():
    call = api.StepCall("cpu", 64, 64, jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))
    assert api.STEP_TABLE.choose("auto", call).name == "xla"
    with pytest.raises(ValueError, match="pallas_triton.*GPU only"):
        api.STEP_TABLE.choose("pallas_triton", call)
    wide = api.StepCall("gpu", 64, 64, jnp.dtype(jnp.float64), jnp.dtype(jnp.float64))
    assert api.STEP_TABLE.choose("auto", wide).name == "xla"  # float64 stays on the exact path
    odd = api.StepCall("gpu", 48, 64, jnp.dtype(jnp.float32), jnp.dtype(jnp.float32))
    assert "key_dim=48" in decode_pallas_triton.supports(odd.backend, 48, 64, odd.dtype, odd.state_dtype)


gpu = pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a CUDA GPU")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype, tol", [(jnp.float32, 2e-6), (jnp.bfloat16, 1e-2)])
def test_gpu_decode_matches_reference(dtype, tol):
    steps = 16
    inputs = gdn2_inputs(5, 4, steps, 4, 128, 128, dtype=np.float32)
    cast = {n: jnp.asarray(x, jnp.float32 if n in ("log_decay", "initial_state") else dtype)
            for n, x in inputs.items()}
    step = jax.jit(lambda q, k, e, v, lam, s: delta_rule_step(q, k, v, erase_key=e, log_decay=lam, state=s,
                                                              implementation="pallas_triton"))
    out, state = _loop(cast, steps, step)
    rounded = {n: np.asarray(jnp.asarray(x, jnp.float32)) for n, x in cast.items()}
    ref_out, ref_state = _reference(rounded, steps)
    assert rel_rms_err(out, ref_out) <= tol
    assert rel_rms_err(state, ref_state) <= tol
