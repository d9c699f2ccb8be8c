"""The DPLR op as two delta-rule tokens per token (``implementation="delta_pairs"``, what RWKV-7 runs): against the
float64 token scan (outputs, final state, the gradients of every input), f32 and bf16 operands, packed documents,
per-head decay; the delta-rule op's GPU kernels (by the interpreter) and TPU kernel (a Mosaic compile) under it."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from delta_rule_cases import x64
from mixerlab.pallas_kernels import dispatch
from mixerlab.pallas_kernels.delta_rule import api as delta_rule_api, pallas_triton
from mixerlab.pallas_kernels.dplr_delta_rule import delta_pairs
from test_dplr_delta_rule import SEGMENTS, rel_err, run, rwkv7_inputs
from tpu_topologies import one_device_mesh

NAMES = ("q", "k", "v", "alpha", "beta", "log_decay", "initial_state")


def grads_of(inputs, implementation, seg, **tiling):
    """(o, S) and the gradients of every input of a fixed random projection of both."""
    b, t, h, dv = inputs["v"].shape
    dk = inputs["q"].shape[-1]
    probe_o = jnp.asarray(np.random.default_rng(4).standard_normal((b, t, h, dv)), jnp.float32)
    probe_s = jnp.asarray(np.random.default_rng(5).standard_normal((b, h, dk, dv)), jnp.float32)

    def loss(*arrays):
        o, s = run(dict(zip(NAMES, arrays)), implementation, segment_ids=seg, **tiling)
        acc = s.dtype  # float32, or float64 for float64 inputs
        return jnp.sum(o.astype(acc) * probe_o.astype(acc)) + jnp.sum(s * probe_s.astype(acc)), (o, s)

    (_, (o, s)), grads = jax.jit(jax.value_and_grad(loss, tuple(range(len(NAMES))), has_aux=True))(
        *(inputs[n] for n in NAMES))
    return o, s, grads


def wide(inputs):
    return {n: jnp.asarray(np.asarray(x, np.float64)) for n, x in inputs.items()}


def test_interleave_puts_the_first_at_even_positions():
    a, b = jnp.arange(6).reshape(1, 3, 2), -jnp.arange(6).reshape(1, 3, 2)
    np.testing.assert_array_equal(delta_pairs.interleave(a, b), [[[0, 1], [0, -1], [2, 3], [-2, -3], [4, 5], [-4, -5]]])


@pytest.mark.parametrize("t, dk, dv, decay, segmented, tiling", [
    (37, 8, 6, "channel", True, {}), (29, 16, 16, "head", False, {}), (33, 8, 8, "channel", True,
                                                                       dict(chunk_size=16, leaf_size=4))])
def test_matches_the_float64_scan_with_every_gradient(t, dk, dv, decay, segmented, tiling):
    """Exact to rounding in float64: the pairs reproduce the DPLR recurrence, and autodiff through the interleave
    and α's rescaling by e^{−λ} gives every input's gradient (λ's through both of its uses)."""
    with x64():
        inputs = rwkv7_inputs(7, 2, t, 2, dk, dv)
        if decay == "head":
            inputs["log_decay"] = inputs["log_decay"][..., 0]
        seg = jnp.asarray(SEGMENTS[:, :t]) if segmented else None
        want = grads_of(inputs, "reference", seg)
        got = grads_of(inputs, "delta_pairs", seg, **tiling)
        for name, g, w in zip(("o", "final state") + NAMES, (*got[:2], *got[2]), (*want[:2], *want[2])):
            assert rel_err(g, w) < 1e-10, name


@pytest.mark.parametrize("dtype, tol", [(jnp.float32, 2e-5), (jnp.bfloat16, 1e-2)])
def test_low_precision_against_float64(dtype, tol):
    """f32 and bf16 operands (float32 state and decays) against the float64 scan of the same rounded inputs,
    relative to the largest |value|: f32 2e-5, bf16 1e-2 (outputs rounded to bf16, α·e^{−λ} rounded once more).
    The gradients are checked in float64 above; here the outputs and the final state."""
    t = 45
    inputs = rwkv7_inputs(6, 2, t, 2, 16, 16, dtype=dtype)
    seg = jnp.asarray(np.pad(SEGMENTS, ((0, 0), (0, t - SEGMENTS.shape[1])), "edge"))
    o, s = jax.jit(lambda x: run(x, "delta_pairs", segment_ids=seg))(inputs)
    assert o.dtype == dtype and s.dtype == jnp.float32
    with x64():
        o_ref, s_ref = run(wide(inputs), "reference", segment_ids=seg)
    assert rel_err(o, o_ref) < tol and rel_err(s, s_ref) < tol


def test_on_the_delta_rule_gpu_kernels_by_the_interpreter(monkeypatch):
    """The delta-rule op's Triton kernels (interpret mode, served for this CPU call) under the pairs: float32
    outputs, final state and every gradient within 1e-4 of the float64 scan (chunk 32 of 2T = 64 tokens)."""
    run_interpreted = lambda *a, **kw: pallas_triton.run(*a, interpret=True, **kw)  # noqa: E731
    monkeypatch.setitem(delta_rule_api.TABLE._impls, "pallas_triton",
                        dispatch.Implementation("pallas_triton", run_interpreted, lambda call: None, fast=True))
    chosen = []
    choose = delta_rule_api.TABLE.choose
    def choose_and_record(*args):
        impl = choose(*args)
        chosen.append(impl.name)
        return impl

    monkeypatch.setattr(delta_rule_api.TABLE, "choose", choose_and_record)
    t = 32
    inputs = rwkv7_inputs(8, 1, t, 2, 16, 16, dtype=np.float32)
    seg = jnp.asarray(SEGMENTS[:1, :t])
    got = grads_of(inputs, "delta_pairs", seg, chunk_size=32, leaf_size=16)
    assert set(chosen) == {"pallas_triton"}
    with x64():
        want = grads_of(wide(inputs), "reference", seg)
    for name, g, w in zip(("o", "final state") + NAMES, (*got[:2], *got[2]), (*want[:2], *want[2])):
        assert rel_err(g, w) < 1e-4, name


@pytest.mark.tpu_compile
def test_takes_the_delta_rule_tpu_kernel_and_compiles_for_v5p():
    """Traced under a v5p mesh as the trainer traces its step: the pairs run on the delta-rule op's Pallas TPU
    kernel (Mosaic custom calls in the program, forward and backward), bf16 operands, packed documents, and the
    gradient compiles. RWKV-7's head width (64), T = 256 (512 delta-rule tokens: two chunks of 256)."""
    mesh = one_device_mesh("v5p")
    b, t, h, dk, dv = 1, 256, 2, 64, 64
    rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    sd = lambda s, d=jnp.bfloat16: jax.ShapeDtypeStruct(s, d, sharding=rep)  # noqa: E731
    specs = [sd((b, t, h, dk)), sd((b, t, h, dk)), sd((b, t, h, dv)), sd((b, t, h, dk)), sd((b, t, h, dk)),
             sd((b, t, h, dk), jnp.float32), sd((b, h, dk, dv), jnp.float32), sd((b, t), jnp.int32)]

    def loss(q, k, v, alpha, beta, lam, s0, seg):
        o, s = run(dict(q=q, k=k, v=v, alpha=alpha, beta=beta, log_decay=lam, initial_state=s0), "delta_pairs",
                   segment_ids=seg)
        return jnp.sum(o.astype(jnp.float32) ** 2) + jnp.sum(s ** 2)

    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
        lowered = jax.jit(jax.grad(loss, argnums=tuple(range(7)))).trace(*specs).lower()
    assert lowered.as_text().count("tpu_custom_call") >= 2
    lowered.compile()


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype, tol", [(jnp.float32, 1e-3), (jnp.bfloat16, 3e-2)], ids=["f32", "bf16"])
def test_gpu_kernels_under_the_pairs_match_the_float64_scan(dtype, tol):
    """On the GPU the pairs take the delta-rule Triton kernels: outputs, final state and every gradient at
    RWKV-7's head width (64), T = 150 (300 delta-rule tokens), packed documents."""
    t = 150
    inputs = rwkv7_inputs(9, 2, t, 2, 64, 64, dtype=dtype)
    seg = jnp.asarray(np.stack([np.repeat([1, 2, 1], [40, 70, 40]), np.full(t, 3)]).astype(np.int32))
    with jax.default_matmul_precision("highest" if dtype == jnp.float32 else None):
        got = grads_of(inputs, "delta_pairs", seg)
    with x64():
        want = grads_of(wide(inputs), "reference", seg)
    for name, g, w in zip(("o", "final state") + NAMES, (*got[:2], *got[2]), (*want[:2], *want[2])):
        assert rel_err(g, w) < tol, name
