"""Pallas TPU delta-rule kernel (pallas_kernels/delta_rule/pallas_tpu.py, pallas_tpu_bwd.py) without a TPU:

* interpret mode on CPU against the float64 reference (``implementation="reference"`` under x64): outputs,
  final state and the gradients of all six inputs (q, k, erase_key, v, log_decay, initial_state) through the
  custom VJP (forward and backward kernels); relative RMS ≤ 1e-4 for float32 operands, ≤ 2e-2 for bfloat16;
  odd T, segment boundaries mid-chunk / at a chunk edge / a document shorter than a leaf, the extreme-decay
  stress case (λ ≈ −20 per token and channel: chunk-end Λ ≈ −5000 at C = 256);
* the TPU interpreter's race detector on both kernels;
* real Mosaic compiles for TPU v5e, v6e and v5p through libtpu (forward and fwd+bwd), marked ``tpu_compile``.
"""
from __future__ import annotations

import os

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # pytest-xdist: two workers may load libtpu

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from jax.experimental.pallas import tpu as pltpu  # noqa: E402

from delta_rule_cases import gdn2_inputs, rel_rms_err, segment_ids_from_lengths, x64  # noqa: E402
from mixerlab.pallas_kernels.delta_rule import api, flops, pallas_tpu  # noqa: E402
from tpu_topologies import TOPOLOGIES, replicated  # noqa: E402
from mixerlab.pallas_kernels.delta_rule import pallas_tpu_bwd  # noqa: E402,F401  (import check)

NAMES = ("q", "k", "erase_key", "v", "log_decay", "initial_state")
F32_TOL = 1e-4
BF16_TOL = 2e-2


def _weights(seed, batch, length, heads, dk, dv):
    rng = np.random.default_rng(seed)
    return (jnp.asarray(rng.normal(size=(batch, length, heads, dv)), jnp.float32),
            jnp.asarray(rng.normal(size=(batch, heads, dk, dv)), jnp.float32))


def _value_and_grads(fn, args, weights):
    w_out, w_state = weights

    def loss(*xs):
        out, state = fn(**dict(zip(NAMES, xs)))
        dt = state.dtype
        return jnp.sum(out.astype(dt) * w_out.astype(dt)) + jnp.sum(state * w_state.astype(dt)), (out, state)

    (_, (out, state)), grads = jax.jit(jax.value_and_grad(loss, argnums=tuple(range(len(NAMES))), has_aux=True))(*args)
    return out, state, grads


def _kernel_vs_reference(inputs, segment_ids, chunk_size, leaf_size, dtype):
    """Kernel (interpret mode) with ``dtype`` operands vs the float64 reference on the SAME (rounded) inputs.
    Returns {name: relative RMS error} for o, final state and the six gradients."""
    args = [inputs[n] for n in NAMES]
    args = [a.astype(dtype) if n in ("q", "k", "erase_key", "v") else a.astype(jnp.float32)
            for n, a in zip(NAMES, args)]
    b, t, h, dk = inputs["q"].shape
    weights = _weights(99, b, t, h, dk, inputs["v"].shape[-1])
    kern = lambda **kw: pallas_tpu.delta_rule_interpret(**kw, segment_ids=segment_ids,  # noqa: E731
                                                        chunk_size=chunk_size, leaf_size=leaf_size)
    out, state, grads = _value_and_grads(jax.jit(kern), args, weights)
    assert out.dtype == jnp.dtype(dtype) and state.dtype == jnp.float32
    for n, g in zip(NAMES, grads):
        assert g.dtype == args[NAMES.index(n)].dtype
    with x64():
        args64 = [jnp.asarray(np.asarray(a.astype(jnp.float32)), jnp.float64) for a in args]
        ref = lambda **kw: api.delta_rule(**kw, segment_ids=segment_ids, implementation="reference")  # noqa: E731
        ref_out, ref_state, ref_grads = _value_and_grads(jax.jit(ref), args64, weights)
    errors = {"o": rel_rms_err(out, ref_out), "final_state": rel_rms_err(state, ref_state)}
    for n, g, rg in zip(NAMES, grads, ref_grads):
        assert np.all(np.isfinite(np.asarray(g, np.float64))), n
        errors["d_" + n] = rel_rms_err(g, rg)
    assert np.all(np.isfinite(np.asarray(out, np.float64)))
    return errors


def _assert_within(errors, tol):
    bad = {n: e for n, e in errors.items() if not e <= tol}
    assert not bad, f"relative RMS above {tol}: {bad} (all: {errors})"


# ---------------------------------------------------------------------------------------------------------
# interpret mode vs float64


SEGMENTS_64 = (37, 27, 5, 81)  # boundaries at 37 (mid-chunk), 64 (chunk edge at C=64), 69 (5-token document)


def test_float32_segments_odd_length_c64():
    """C = 64, n0 = 8, d = 64, T = 150 (padded to 192), packed documents, channel-wise decay, initial state."""
    inputs = gdn2_inputs(0, 1, 150, 2, 64, 64, dtype=np.float32)
    errors = _kernel_vs_reference(inputs, segment_ids_from_lengths(SEGMENTS_64), 64, 8, jnp.float32)
    _assert_within(errors, F32_TOL)


@pytest.mark.extended  # segments and odd lengths stay covered at C 64 in make test
def test_float32_c128_rectangular_state():
    """C = 128, n0 = 16, d_k = 64 ≠ d_v = 128, T = 200, B = 2 × H = 2 (the document index map is per batch
    row): row 0 has boundaries at 128 (chunk edge) and 150, row 1 one at 20 and a reused id at 90."""
    inputs = gdn2_inputs(1, 2, 200, 2, 64, 128, dtype=np.float32)
    ids = np.zeros((2, 200), np.int32)
    ids[0, 128:] = 1
    ids[0, 150:] = 2
    ids[1, 20:] = 3
    ids[1, 90:] = 0  # a reused id after another segment is a new document
    errors = _kernel_vs_reference(inputs, jnp.asarray(ids), 128, 16, jnp.float32)
    _assert_within(errors, F32_TOL)


def test_bfloat16_operands():
    """bfloat16 q, k, k̂, v on the MXU (f32 accumulation), f32 λ and state; C = 64, d = 128."""
    inputs = gdn2_inputs(2, 1, 130, 2, 128, 128, dtype=np.float32)
    errors = _kernel_vs_reference(inputs, segment_ids_from_lengths((90, 40)), 64, 8, jnp.bfloat16)
    _assert_within(errors, BF16_TOL)


@pytest.mark.extended  # the c64 extreme-decay test covers the same numerics at a quarter of the cost
def test_default_config_extreme_decay_c256():
    """Muir's default tiling (C = 256, n0 = 8, d = 128) with λ ≈ −20 per token and channel on one of the two
    heads: chunk-end Λ ≈ −5000. The pivoted kernel stays finite and within 1e-4 of float64,
    forward and backward; T = 300 (two chunks, padded)."""
    inputs = gdn2_inputs(3, 1, 300, 2, 128, 128, dtype=np.float32, strong_decay_heads=1)
    lam_end = float(jnp.min(jnp.sum(inputs["log_decay"][:, :256], axis=1)))
    assert lam_end < -4000
    errors = _kernel_vs_reference(inputs, None, 256, 8, jnp.float32)
    _assert_within(errors, F32_TOL)


def test_extreme_decay_c64_every_head():
    """The stress case on every head at C = 64 (chunk-end Λ ≈ −1300), with segments."""
    inputs = gdn2_inputs(4, 1, 128, 2, 64, 64, dtype=np.float32, strong_decay_heads=2)
    errors = _kernel_vs_reference(inputs, segment_ids_from_lengths((50, 78)), 64, 8, jnp.float32)
    _assert_within(errors, F32_TOL)


def test_cancellation_hazard_range_sums():
    """The cancellation hazard (docs/math/delta_rule.md, 'Boundary pivots'):
    λ = −1500 on 4 tokens, then −1e-3. Exponents formed as differences of
    chunk-global prefix sums lose ulp(|Λ|) ≈ 5e-4 and give ~1.5e-3 relative error here (measured with an
    earlier Λ_i − Λ_p version of this kernel); the kernel's range sums keep it at float32 rounding."""
    inputs = gdn2_inputs(9, 1, 128, 1, 64, 64, dtype=np.float32)
    lam = np.full((1, 128, 1, 64), -1e-3, np.float32)
    lam[:, 2:6] = -1500.0
    inputs["log_decay"] = jnp.asarray(lam)
    errors = _kernel_vs_reference(inputs, None, 128, 8, jnp.float32)
    _assert_within(errors, F32_TOL)


def test_no_erase_no_decay_is_linear_attention():
    """k̂ = 0, λ = 0: the kernel degenerates to linear attention (T = I); no initial state."""
    inputs = gdn2_inputs(5, 1, 64, 1, 64, 64, dtype=np.float32, erase=False, decay=None, initial_state=False)
    args = dict(q=inputs["q"], k=inputs["k"], v=inputs["v"])
    out, state = jax.jit(lambda **kw: pallas_tpu.delta_rule_interpret(**kw, chunk_size=64, leaf_size=8))(**args)
    with x64():
        ref_out, ref_state = api.delta_rule(**{n: x.astype(jnp.float64) for n, x in args.items()},
                                            implementation="reference")
    assert rel_rms_err(out, ref_out) <= F32_TOL and rel_rms_err(state, ref_state) <= F32_TOL


# ---------------------------------------------------------------------------------------------------------
# the declared CostEstimates count what the kernels issue


def _kernel_work(jaxpr):
    """(matmul FLOPs, exp elements) of one grid step of a kernel body, sub-jaxprs included."""
    mm_flops = exps = 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            (contract, _), _ = eqn.params["dimension_numbers"]
            lhs = eqn.invars[0].aval.shape
            mm_flops += 2 * int(np.prod(eqn.outvars[0].aval.shape)) * int(np.prod([lhs[a] for a in contract]))
        elif eqn.primitive.name == "exp":
            exps += int(np.prod(eqn.outvars[0].aval.shape))
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else (param,):
                sub = getattr(sub, "jaxpr", sub)
                if hasattr(sub, "eqns"):
                    m, e = _kernel_work(sub)
                    mm_flops, exps = mm_flops + m, exps + e
    return mm_flops, exps


def _pallas_calls(jaxpr):
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            yield eqn
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else (param,):
                sub = getattr(sub, "jaxpr", sub)
                if hasattr(sub, "eqns"):
                    yield from _pallas_calls(sub)


@pytest.mark.parametrize("chunk, leaf, dk, dv", [(256, 8, 128, 128), (128, 16, 64, 128), (64, 8, 64, 64)])
def test_cost_estimates_count_the_issued_matmuls(chunk, leaf, dk, dv):
    """Sum of 2·M·N·K over every dot_general in the forward and backward kernel bodies (traced, not run) ×
    the grid = the declared CostEstimate FLOPs, exactly, and likewise the exp elements = its transcendentals.
    At Muir's default the forward issues Table 8's MXU FLOPs per token."""
    b, t, h = 1, 2 * chunk, 2
    q = jnp.zeros((b, t, h, dk), jnp.bfloat16)
    v = jnp.zeros((b, t, h, dv), jnp.bfloat16)
    lam = jnp.zeros((b, t, h, dk), jnp.float32)
    s0 = jnp.zeros((b, h, dk, dv), jnp.float32)
    doc = jnp.zeros((b, t), jnp.int32)

    def loss(q, k, e, v, lam, s0):
        o, s = pallas_tpu.run(q, k, e, v, lam, s0, doc, chunk_size=chunk, leaf_size=leaf)
        return jnp.sum(o.astype(jnp.float32)) + jnp.sum(s)

    closed = jax.make_jaxpr(jax.grad(loss, argnums=tuple(range(6))))(q, q, q, v, lam, s0)
    calls = {eqn.params["name"]: eqn for eqn in _pallas_calls(closed.jaxpr)}
    assert set(calls) == {"delta_rule_fwd", "delta_rule_bwd"}
    for eqn in calls.values():
        declared = eqn.params["cost_estimate"]
        mm_flops, exps = _kernel_work(eqn.params["jaxpr"])
        steps = int(np.prod(eqn.params["grid_mapping"].grid))
        assert steps == b * h * (t // chunk)
        assert steps * mm_flops == declared.flops, eqn.params["name"]
        assert steps * exps == declared.transcendentals, eqn.params["name"]
    g = pallas_tpu.Geometry(chunk, leaf, dk, dv)
    if (chunk, leaf, dk, dv) == (256, 8, 128, 128):
        ideal = flops.total(flops.forward_stages(flops.KernelConfig())).mxu
        assert pallas_tpu.forward_counts(g)[0] / chunk == ideal == 468_096


# ---------------------------------------------------------------------------------------------------------
# race detector


def test_no_races_forward_and_backward():
    """TPU interpret mode with race detection (simulated HBM/VMEM/DMAs) on both kernels: 2 heads x 2 chunks."""
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call as tpu_interpret

    inputs = gdn2_inputs(6, 1, 128, 2, 64, 64, dtype=np.float32)
    b, t, h, dk = inputs["q"].shape
    params = pltpu.InterpretParams(detect_races=True)
    doc = jnp.asarray(np.repeat(np.arange(2), [70, 58])[None].astype(np.int32))

    def loss(q, k, e, v, lam, s0):
        out, final = pallas_tpu.run(q, k, e, v, lam, s0, doc, chunk_size=64, leaf_size=8, interpret=params)
        return jnp.sum(out * out) + jnp.sum(final * final)

    args = [inputs[n] for n in NAMES]
    grads = jax.jit(jax.grad(loss, argnums=tuple(range(6))))(*args)
    jax.block_until_ready(grads)
    assert tpu_interpret.races is not None
    assert not tpu_interpret.races.races_found
    assert all(np.all(np.isfinite(np.asarray(g))) for g in grads)


# ---------------------------------------------------------------------------------------------------------
# dispatch predicate


def _call(**kw):
    base = dict(batch=2, length=4096, heads=16, key_dim=128, value_dim=128, dtype=jnp.dtype(jnp.bfloat16),
                has_erase=True, decay="channel", has_initial_state=True, has_segments=True, chunk_size=256,
                leaf_size=8, backend="tpu")
    base.update(kw)
    return api.DeltaRuleCall(**base)


def test_supports():
    assert pallas_tpu.supports(_call()) is None
    assert pallas_tpu.supports(_call(dtype=jnp.dtype(jnp.float32), chunk_size=64, key_dim=64)) is None
    assert pallas_tpu.supports(_call(chunk_size=128, leaf_size=16, value_dim=256)) is None
    for bad in (dict(backend="cpu"), dict(chunk_size=32, leaf_size=8), dict(leaf_size=2), dict(leaf_size=64),
                dict(value_dim=129), dict(key_dim=32), dict(dtype=jnp.dtype(jnp.float64))):
        reason = pallas_tpu.supports(_call(**bad))
        assert isinstance(reason, str) and reason, bad


def test_run_rejects_unsupported_tiling():
    x = jnp.zeros((1, 8, 1, 64), jnp.float32)
    with pytest.raises(ValueError, match="leaf_size"):
        pallas_tpu.run(x, x, x, x, x, jnp.zeros((1, 1, 64, 64)), jnp.zeros((1, 8), jnp.int32), chunk_size=64,
                       leaf_size=2)


# ---------------------------------------------------------------------------------------------------------
# real compiles through libtpu (no TPU needed)

def _compile(gen, chunk, leaf, dk, dv, dtype, backward, *, batch=1, length=512, heads=2):
    rep = replicated(gen)
    sd = lambda s, d: jax.ShapeDtypeStruct(s, d, sharding=rep)  # noqa: E731
    x = (batch, length, heads)
    specs = [sd(x + (dk,), dtype), sd(x + (dk,), dtype), sd(x + (dk,), dtype), sd(x + (dv,), dtype),
             sd(x + (dk,), jnp.float32), sd((batch, heads, dk, dv), jnp.float32), sd((batch, length), jnp.int32)]

    def fwd(q, k, e, v, lam, s0, doc):
        return pallas_tpu.run(q, k, e, v, lam, s0, doc, chunk_size=chunk, leaf_size=leaf)

    if backward:
        def fn(*a):
            def loss(q, k, e, v, lam, s0):
                o, s = fwd(q, k, e, v, lam, s0, a[-1])
                return jnp.sum(o.astype(jnp.float32) ** 2) + jnp.sum(s ** 2)
            return jax.value_and_grad(loss, argnums=tuple(range(6)))(*a[:-1])
    else:
        fn = fwd
    return jax.jit(fn).lower(*specs).compile()


@pytest.mark.tpu_compile
@pytest.mark.parametrize("gen", list(TOPOLOGIES))
def test_compiles_default_config(gen):
    """Muir's default (C = 256, n0 = 8, d_k = d_v = 128, bf16): forward alone, and forward + backward; the
    declared CostEstimate is what cost_analysis reports."""
    compiled = _compile(gen, 256, 8, 128, 128, jnp.bfloat16, backward=False)
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    expected = pallas_tpu.forward_cost(pallas_tpu.Geometry(256, 8, 128, 128), 2, 2, 2)
    # the program = the kernel's CostEstimate + the layout glue's integer ops on the document ids (≤ 2 per token)
    assert 0 <= cost["flops"] - expected.flops <= 2 * 512
    assert cost["flops"] / (2 * 512) <= 1.3 * flops.total(flops.forward_stages(flops.KernelConfig())).mxu
    assert cost["transcendentals"] == pytest.approx(expected.transcendentals, rel=1e-6)
    _compile(gen, 256, 8, 128, 128, jnp.bfloat16, backward=True)


@pytest.mark.tpu_compile
@pytest.mark.parametrize("gen", list(TOPOLOGIES))
@pytest.mark.parametrize("chunk, leaf, dk, dv, dtype", [(128, 8, 64, 64, jnp.bfloat16),
                                                        (64, 8, 256, 256, jnp.bfloat16)])
def test_compiles_other_configs(gen, chunk, leaf, dk, dv, dtype):
    """Forward + backward at other tilings / head dims (the forward kernel is part of the program)."""
    _compile(gen, chunk, leaf, dk, dv, dtype, backward=True)


@pytest.mark.tpu_compile
@pytest.mark.extended  # the default-config compiles for every generation stay in make test
@pytest.mark.parametrize("gen", list(TOPOLOGIES))
def test_compiles_float32_and_wide_heads_c256(gen):
    """The heaviest kernels: f32 operands at C = 256 (bwd ≈ 18 MiB scoped VMEM) and d = 256 at C = 256."""
    _compile(gen, 256, 8, 128, 128, jnp.float32, backward=True)
    _compile(gen, 256, 8, 256, 256, jnp.bfloat16, backward=True)
