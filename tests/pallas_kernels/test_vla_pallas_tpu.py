"""Pallas TPU VLA A-pass (pallas_kernels/vla/pallas_tpu.py, pallas_tpu_bwd.py) and the op's "pallas_tpu"
implementation, without a TPU:

* interpret mode on CPU against the float64 reference scan: α̂, the final A and the custom-VJP gradients
  w.r.t. k̂, u and A₀ (documents inside grid chunks, on chunk edges and one token long, refreshes, zero keys,
  an SPD initial A₀); the whole op (A-pass kernels + the delta rule's TPU kernels for the S-pass, both in
  interpret mode) with all six input gradients in float32 and bfloat16, odd T, packed segments incl. a
  boundary on a chunk edge, an initial state;
* the TPU interpreter's race detector on both kernels;
* the declared CostEstimates: positive, linear in tokens and heads, quadratic in d, and equal to the element
  operations the traced kernel bodies issue (leading d² terms);
* dispatch: "auto" picks the kernel on a TPU and falls back to "xla" elsewhere; supports() reasons;
* real Mosaic compiles for TPU v5e, v6e and v5p through libtpu, marked ``tpu_compile``: the A-pass kernels
  (forward, forward + backward) and, marked ``extended``, the whole op as "auto" picks it under a TPU mesh.
"""
from __future__ import annotations

import os

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # pytest-xdist: two workers may load libtpu

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from jax.experimental.pallas import tpu as pltpu  # noqa: E402

from mixerlab.pallas_kernels.vla import api, pallas_tpu, reference  # noqa: E402
from mixerlab.pallas_kernels.vla import pallas_tpu_bwd  # noqa: E402,F401  (import check)
from tpu_topologies import TOPOLOGIES, one_device_mesh  # noqa: E402
from test_vla_pallas_triton import (  # noqa: E402
    A_PASS_CASES, EPS, LAMBDA0, OP_NAMES, RHO, _a_pass_inputs, _op_loss, _reference_a_pass, _rel_rms, _spd, _sym,
    run_per_shard_script)

CHUNK = 8  # tokens per grid step in the A-pass cases: T = 45 spans 6 grid steps
F32_TOL = 1e-4
BF16_TOL = 2e-2


@jax.jit
def _kernel_a_pass(k_hat, u, a0, document, refresh, w_alpha, w_a):
    def loss(k_hat, u, a0):
        alpha, a = pallas_tpu.penalty_pass(k_hat, u, a0, document, refresh, lambda0=LAMBDA0, refresh_magnitude=RHO,
                                           eps=EPS, chunk=CHUNK, interpret=True)
        return jnp.sum(alpha * w_alpha) + jnp.sum(a * w_a), (alpha, a)

    return jax.grad(loss, argnums=(0, 1, 2), has_aux=True)(k_hat, u, a0)


# ---------------------------------------------------------------------------------------------------------
# interpret mode vs float64


@pytest.mark.parametrize("case", sorted(A_PASS_CASES))
def test_interpret_a_pass_matches_reference_f32(case):
    """α̂, A_T and d/dk̂, d/du, d/dA₀ of the kernels vs the float64 reference: rel-RMS ≤ 1e-5 (measured
    ≤ 7e-7). The cases put documents inside grid chunks (5, 19, 20: a one-token document), on chunk edges
    (16, 24, 40), refreshes with offsets and initial positions, and zero keys (the ε floors)."""
    args, weights = _a_pass_inputs(1, **A_PASS_CASES[case])
    grads, (alpha, a) = _kernel_a_pass(*args, *(jnp.asarray(x, jnp.float32) for x in weights))
    ref_grads, (ref_alpha, ref_a) = _reference_a_pass(*args, *weights)
    assert alpha.dtype == jnp.float32 and a.dtype == jnp.float32
    assert _rel_rms(alpha, ref_alpha) <= 1e-5, _rel_rms(alpha, ref_alpha)
    assert _rel_rms(a, ref_a) <= 1e-5, _rel_rms(a, ref_a)
    ref_grads[2] = _sym(ref_grads[2])  # the op symmetrises A₀: only the symmetric part of dA₀ is defined
    for name, g, r in zip(("k_hat", "u", "A0"), grads, ref_grads):
        assert np.all(np.isfinite(np.asarray(g))), name
        assert _rel_rms(g, r) <= 1e-5, (name, _rel_rms(g, r))


def test_interpret_a_stays_exactly_symmetric():
    """The exact orientation changes keep A (forward) and dA₀ (backward) bitwise symmetric."""
    args, weights = _a_pass_inputs(2, **A_PASS_CASES["packed_refresh_offset"])
    a0 = args[2]
    args = (*args[:2], 0.5 * (a0 + jnp.swapaxes(a0, -1, -2)), *args[3:])
    w_a = np.asarray(weights[1])
    grads, (_, a) = _kernel_a_pass(*args, jnp.asarray(weights[0], jnp.float32),
                                   jnp.asarray(0.5 * (w_a + np.swapaxes(w_a, -1, -2)), jnp.float32))
    for x in (np.asarray(a), np.asarray(grads[2])):
        assert np.array_equal(x, np.swapaxes(x, -1, -2))


@pytest.mark.extended  # ~1 min: the short cases above cover every code path
def test_interpret_a_pass_long_document_f32():
    """One 1024-token document (d = 32, default chunk 64, ELU+1 keys, penalty keys, the default λ₀, ρ, P):
    the float32 chain against float64 over a long Sherman–Morrison sequence. Measured: α̂ 5.3e-7, A 3.5e-7,
    dk̂ 4.3e-7, du 5.1e-5, dA₀ 8.5e-5 (the GPU kernel gives 4.9e-5, 8.7e-5; the du error sits in the first
    ~64 tokens, where A ≈ I/λ₀ is large; float32 autodiff of the reference scan: du 1.2e-6, dA₀ 0.44)."""
    b, t, h, d = 1, 1024, 1, 32
    rng = np.random.default_rng(7)
    k_hat = api.normalize(jnp.asarray(np.asarray(jax.nn.elu(rng.normal(size=(b, t, h, d)))) + 1.0, jnp.float32), EPS)
    u = api.normalize(jnp.asarray(rng.normal(size=(b, t, h, d)) + 0.5, jnp.float32), EPS)
    a0 = jnp.broadcast_to(jnp.eye(d, dtype=jnp.float32) / api.DEFAULT_LAMBDA0, (b, h, d, d))
    document = jnp.zeros((b, t), jnp.int32)
    refresh = api.refresh_mask(api.document_positions(document), api.DEFAULT_REFRESH_PERIOD, 0)
    w_alpha, w_a = rng.normal(size=(b, t, h, d)), rng.normal(size=(b, h, d, d))
    hyper = dict(lambda0=api.DEFAULT_LAMBDA0, refresh_magnitude=api.DEFAULT_REFRESH_MAGNITUDE, eps=EPS)

    def loss(run, k_hat, u, a0, w_alpha, w_a):
        alpha, a = run(k_hat, u, a0, document, refresh)
        return jnp.sum(alpha * w_alpha) + jnp.sum(a * w_a), (alpha, a)

    def kernel(*x):
        return pallas_tpu.penalty_pass(*x, **hyper, interpret=True)

    def reference_run(k_hat, u, a0, document, refresh):
        zeros = jnp.zeros((b, t, h, 1), k_hat.dtype)
        _, (_, a), diag = reference.vla_reference(zeros, k_hat, u, zeros, jnp.zeros((b, h, d, 1), k_hat.dtype), a0,
                                                  document, refresh, **hyper, diagnostics=True)
        return diag["alpha"], a

    grads, (alpha, a) = jax.jit(jax.grad(lambda *x: loss(kernel, *x), argnums=(0, 1, 2), has_aux=True))(
        k_hat, u, a0, jnp.asarray(w_alpha, jnp.float32), jnp.asarray(w_a, jnp.float32))
    with jax.enable_x64(True):
        wide = [jnp.asarray(np.asarray(x), jnp.float64) for x in (k_hat, u, a0, w_alpha, w_a)]
        ref_grads, (ref_alpha, ref_a) = jax.jit(jax.grad(lambda *x: loss(reference_run, *x), argnums=(0, 1, 2),
                                                         has_aux=True))(*wide)
    errors = {"alpha": _rel_rms(alpha, ref_alpha), "A": _rel_rms(a, ref_a)}
    errors.update({"d_" + n: _rel_rms(g, _sym(r) if n == "A0" else r)
                   for n, g, r in zip(("k_hat", "u", "A0"), grads, ref_grads)})
    print({n: f"{e:.1e}" for n, e in errors.items()})
    bounds = {"alpha": 1e-5, "A": 1e-5, "d_k_hat": 1e-5, "d_u": 2e-4, "d_A0": 2e-4}
    assert all(errors[n] <= bound for n, bound in bounds.items()), errors


def _op_inputs(dtype):
    """d = 64 so that the S-pass runs the delta rule's TPU kernel too; T = 75 (odd; two grid chunks of 64 in
    both kernels); documents start at 20, 64 (a chunk edge) and 70; initial state (S₀, SPD A₀) and position."""
    b, t, h, d, dv = 1, 75, 2, 64, 64
    rng = np.random.default_rng(3)
    q = np.asarray(jax.nn.elu(rng.normal(size=(b, t, h, d)))) + 1.0
    k = np.asarray(jax.nn.elu(rng.normal(size=(b, t, h, d)))) + 1.0
    v = rng.normal(size=(b, t, h, dv))
    p = rng.normal(size=(b, t, h, d)) + 0.5
    s0 = rng.normal(size=(b, h, d, dv))
    args = [jnp.asarray(x, dtype) for x in (q, k, v, p)] + [jnp.asarray(s0, jnp.float32),
                                                            jnp.asarray(_spd(rng, b, h, d), jnp.float32)]
    segments = jnp.asarray(np.searchsorted([20, 64, 70], np.arange(t), side="right")[None], jnp.int32)
    weights = rng.normal(size=(b, t, h, dv)), rng.normal(size=(b, h, d, dv)), rng.normal(size=(b, h, d, d))
    return args, segments, jnp.asarray([4], jnp.int32), weights


@pytest.mark.parametrize("dtype, tol", [(jnp.float32, F32_TOL),
                                        pytest.param(jnp.bfloat16, BF16_TOL, marks=pytest.mark.extended)])
def test_interpret_op_matches_reference(dtype, tol):
    """o, S, A and the gradients of q, k, v, penalty key, S₀, A₀ of ``api._run_pallas_tpu`` in interpret mode
    (both kernels of the A-pass, both of the delta rule's S-pass) vs the float64 reference on the same
    (rounded) inputs, rel-RMS. bfloat16: the S-pass gets α̂ and k̂ rounded to bfloat16 (the MXU operand dtype)
    and o is bfloat16."""
    args, segments, initial_position, weights = _op_inputs(dtype)

    def kernel_run(*a, **kw):
        return api._run_pallas_tpu(*a, **kw, interpret=True)

    w32 = [jnp.asarray(w, jnp.float32) for w in weights]
    grads, (o, s, a) = jax.jit(jax.grad(lambda *x: _op_loss(kernel_run, *x, segments, initial_position, w32),
                                        argnums=tuple(range(6)), has_aux=True))(*args)
    with jax.enable_x64(True):
        wide = [jnp.asarray(np.asarray(x.astype(jnp.float32)), jnp.float64) for x in args]
        ref_grads, (ref_o, ref_s, ref_a) = jax.jit(jax.grad(
            lambda *x: _op_loss(api._run_reference, *x, segments, initial_position, weights),
            argnums=tuple(range(6)), has_aux=True))(*wide)
    assert o.dtype == dtype and s.dtype == jnp.float32 and a.dtype == jnp.float32
    errors = {name: _rel_rms(got, want) for name, got, want in
              (("o", o.astype(jnp.float32), ref_o), ("S", s, ref_s), ("A", a, ref_a))}
    for name, g, r in zip(OP_NAMES, grads, ref_grads):
        assert g.dtype == args[OP_NAMES.index(name)].dtype, name
        g = np.asarray(g.astype(jnp.float32))
        assert np.all(np.isfinite(g)), name
        errors["d_" + name] = _rel_rms(g, _sym(r) if name == "A0" else r)
    print({n: f"{e:.1e}" for n, e in errors.items()})
    bad = {n: e for n, e in errors.items() if not e <= tol}
    assert not bad, f"relative RMS above {tol}: {bad} (all: {errors})"




@pytest.mark.extended  # ~30 s: a subprocess with 4 CPU devices; the kernels themselves are covered above
def test_per_shard_a_pass_under_a_mesh_matches_unsharded():
    """Under a 2 × 2 (data, tensor) mesh of CPU devices the A-pass kernels run per shard as the op runs them
    (``api.per_shard_a_pass``: batch over "data", heads over "tensor") and give the unsharded gradients of k̂,
    u and A₀ (interpret mode)."""
    run_per_shard_script("pallas_tpu", "")


# ---------------------------------------------------------------------------------------------------------
# race detector


def test_no_races_forward_and_backward():
    """TPU interpret mode with race detection (simulated HBM/VMEM/DMAs) on both kernels: 2 heads × 2 chunks,
    a document start at 5 and one on the chunk edge at 8."""
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call as tpu_interpret

    args, _ = _a_pass_inputs(4, boundaries=[5, 8], period=3, offset=0, initial_position=[0, 0])
    k_hat, u, a0, document, refresh = args
    k_hat, u, document, refresh = (x[:1, :13] for x in (k_hat, u, document, refresh))  # 2 chunks of 8 (padded)
    a0 = a0[:1]
    params = pltpu.InterpretParams(detect_races=True)

    def loss(k_hat, u, a0):
        alpha, a = pallas_tpu.penalty_pass(k_hat, u, a0, document, refresh, lambda0=LAMBDA0, refresh_magnitude=RHO,
                                           eps=EPS, chunk=CHUNK, interpret=params)
        return jnp.sum(alpha * alpha) + jnp.sum(a * a)

    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(k_hat, u, a0)
    jax.block_until_ready(grads)
    assert tpu_interpret.races is not None
    assert not tpu_interpret.races.races_found
    assert all(np.all(np.isfinite(np.asarray(g))) for g in grads)


# ---------------------------------------------------------------------------------------------------------
# CostEstimate


def test_cost_estimate_positive_and_scales():
    base = {k: pallas_tpu.cost(k, 64, 2, 256, 64) for k in ("forward", "backward")}
    for kernel, est in base.items():
        assert est.flops > 0 and est.transcendentals > 0 and est.bytes_accessed > 0
        twice_tokens = pallas_tpu.cost(kernel, 64, 2, 512, 64)
        twice_heads = pallas_tpu.cost(kernel, 64, 4, 256, 64)
        assert twice_tokens.flops == twice_heads.flops == 2 * est.flops
        assert twice_heads.bytes_accessed == 2 * est.bytes_accessed
        thrice_tokens = pallas_tpu.cost(kernel, 64, 2, 768, 64)  # affine in tokens (+ A₀ in and A_T out per head)
        per_256 = twice_tokens.bytes_accessed - est.bytes_accessed
        assert per_256 > 256 * 2 * 64 * 4 and thrice_tokens.bytes_accessed - twice_tokens.bytes_accessed == per_256
        wide = pallas_tpu.cost(kernel, 128, 2, 256, 64)
        assert 3.9 < wide.flops / est.flops <= 4.0  # d² work dominates
    assert base["backward"].flops > 2 * base["forward"].flops


_ELEMENTWISE = {"add", "sub", "mul", "div", "select_n", "max", "min", "neg", "sqrt", "rsqrt"}


def _element_ops(jaxpr, trips=1):
    """Element operations one grid step issues: output elements of every elementwise arithmetic primitive and
    input elements of every reduce_sum, loop bodies times their trip count."""
    ops = 0
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name in _ELEMENTWISE:
            ops += int(np.prod(eqn.outvars[0].aval.shape))
        elif name == "reduce_sum":
            ops += int(np.prod(eqn.invars[0].aval.shape))
        elif name == "scan":
            ops += _element_ops(eqn.params["jaxpr"].jaxpr, eqn.params["length"])
        elif name == "while":  # fori_loop traces to a scan when its bounds are static, as in these kernels
            raise AssertionError("a while loop in a kernel body: its trip count is not static")
        else:
            for param in eqn.params.values():
                for sub in param if isinstance(param, (tuple, list)) else (param,):
                    sub = getattr(sub, "jaxpr", sub)
                    if hasattr(sub, "eqns"):
                        ops += _element_ops(sub)
    return ops * trips


def _pallas_calls(jaxpr):
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            yield eqn
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else (param,):
                sub = getattr(sub, "jaxpr", sub)
                if hasattr(sub, "eqns"):
                    yield from _pallas_calls(sub)


@pytest.mark.parametrize("d", [64, 128])
def test_cost_estimate_counts_the_issued_element_ops(d):
    """The declared flops of each kernel = its traced body's element operations × the grid, up to the O(d)
    vector terms and the per-chunk scalar work (within 3 %)."""
    b, t, h, c = 1, 128, 2, 64
    x = jnp.zeros((b, t, h, d), jnp.float32)
    a0 = jnp.zeros((b, h, d, d), jnp.float32)
    doc, ref = jnp.zeros((b, t), jnp.int32), jnp.zeros((b, t), bool)

    def loss(k_hat, u, a0):
        alpha, a = pallas_tpu.penalty_pass(k_hat, u, a0, doc, ref, lambda0=0.1, refresh_magnitude=1e-3, eps=1e-4,
                                           chunk=c)
        return jnp.sum(alpha) + jnp.sum(a)

    closed = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(x, x, a0)
    calls = {eqn.params["name"]: eqn for eqn in _pallas_calls(closed.jaxpr)}
    assert set(calls) == {"vla_penalty_fwd", "vla_penalty_bwd"}
    for eqn in calls.values():
        declared = eqn.params["cost_estimate"]
        steps = int(np.prod(eqn.params["grid_mapping"].grid))
        assert steps == b * h * (t // c)
        issued = steps * _element_ops(eqn.params["jaxpr"])
        assert abs(issued - declared.flops) <= 0.03 * declared.flops, (eqn.params["name"], issued, declared.flops)
        assert declared.transcendentals == b * h * t


# ---------------------------------------------------------------------------------------------------------
# dispatch


def _call(**kw):
    base = dict(batch=8, length=4096, heads=12, key_dim=128, value_dim=128, dtype=jnp.dtype(jnp.bfloat16),
                has_penalty_key=True, has_initial_state=False, has_segments=True, chunk_size=20, refresh_period=20,
                backend="tpu")
    base.update(kw)
    return api.VLACall(**base)


def test_supports_and_auto():
    assert pallas_tpu.supports(_call()) is None
    assert pallas_tpu.supports(_call(key_dim=64, dtype=jnp.dtype(jnp.float32))) is None
    assert pallas_tpu.supports(_call(key_dim=256)) is None
    for bad, words in ((dict(backend="cpu"), "TPU backend"), (dict(backend="gpu"), "TPU backend"),
                       (dict(key_dim=96), "key_dim=96"), (dict(key_dim=8), "key_dim=8"),
                       (dict(dtype=jnp.dtype(jnp.float16)), "float16")):
        reason = pallas_tpu.supports(_call(**bad))
        assert isinstance(reason, str) and words in reason, (bad, reason)
    assert api.TABLE.choose("auto", _call()).name == "pallas_tpu"
    assert api.TABLE.choose("auto", _call(key_dim=96)).name == "xla"
    assert api.TABLE.choose("auto", _call(backend="cpu")).name == "xla"
    q = jnp.ones((1, 8, 1, 64), jnp.float32)
    with pytest.raises(ValueError, match="implementation='pallas_tpu'.*TPU backend"):
        api.vla(q, q, q, implementation="pallas_tpu")


def test_config_checks():
    assert pallas_tpu.default_chunk(64) == pallas_tpu.default_chunk(128) == 64
    assert pallas_tpu.default_chunk(256) == 16  # C·d²·4 ≤ 4 MiB of per-token A copies in the backward
    for d, chunk, words in ((64, 12, "chunk=12"), (256, 64, "chunk <= 16"), (48, 64, "key_dim=48")):
        with pytest.raises(ValueError, match=words):
            x = jnp.zeros((1, 8, 1, d), jnp.float32)
            pallas_tpu.penalty_pass(x, x, jnp.zeros((1, 1, d, d)), jnp.zeros((1, 8), jnp.int32),
                                    jnp.zeros((1, 8), bool), lambda0=0.1, refresh_magnitude=0.0, eps=1e-4,
                                    chunk=chunk)


# ---------------------------------------------------------------------------------------------------------
# real compiles through libtpu (no TPU needed)

@pytest.mark.tpu_compile
@pytest.mark.parametrize("gen", list(TOPOLOGIES))
def test_compiles_a_pass_default_config(gen):
    """The A-pass kernels at the default chunk, d = 128 (and d = 256, chunk 16): the forward alone, whose
    cost_analysis is the declared CostEstimate plus the XLA normalisation of g, and forward + backward."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    rep = NamedSharding(one_device_mesh(gen), P())
    for d in (128, 256):
        b, t, h = 1, 256, 2
        sd = lambda s, dt: jax.ShapeDtypeStruct(s, dt, sharding=rep)  # noqa: E731
        specs = [sd((b, t, h, d), jnp.float32)] * 2 + [sd((b, h, d, d), jnp.float32), sd((b, t), jnp.int32),
                                                       sd((b, t), jnp.bool_)]

        def fwd(k_hat, u, a0, document, refresh):
            return pallas_tpu.penalty_pass(k_hat, u, a0, document, refresh, lambda0=0.1, refresh_magnitude=1e-3,
                                           eps=1e-4)

        def fwd_bwd(k_hat, u, a0, document, refresh):
            def loss(k_hat, u, a0):
                alpha, a = fwd(k_hat, u, a0, document, refresh)
                return jnp.sum(alpha ** 2) + jnp.sum(a ** 2)
            return jax.value_and_grad(loss, argnums=(0, 1, 2))(k_hat, u, a0)

        compiled = jax.jit(fwd).lower(*specs).compile()
        cost = compiled.cost_analysis()
        cost = cost[0] if isinstance(cost, (list, tuple)) else cost
        declared = pallas_tpu.cost("forward", d, b * h, t, pallas_tpu.default_chunk(d))
        assert declared.flops <= cost["flops"] <= declared.flops + 8 * b * t * h * d, (cost["flops"], declared.flops)
        text = jax.jit(fwd_bwd).lower(*specs).compile().as_text()
        assert "vla_penalty_fwd" in text and "vla_penalty_bwd" in text


@pytest.mark.tpu_compile
@pytest.mark.extended  # ~20 s of CPU per generation, most of it the delta rule's kernels (compiled by their tests)
@pytest.mark.parametrize("gen", list(TOPOLOGIES))
def test_compiles_default_config(gen):
    """The op as "auto" picks it on a TPU (traced under the topology's mesh: the A-pass kernels and the delta
    rule's TPU kernels), d = 128, bf16 inputs, default chunk: the forward alone, whose cost_analysis holds the
    A-pass CostEstimate, and forward + backward."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    mesh = one_device_mesh(gen)
    rep = NamedSharding(mesh, P())
    b, t, h, d = 1, 256, 2, 128
    specs = [jax.ShapeDtypeStruct((b, t, h, d), jnp.bfloat16, sharding=rep)] * 4 + [
        jax.ShapeDtypeStruct((b, t), jnp.int32, sharding=rep)]

    def fwd(q, k, v, p, seg):
        return api.vla(q, k, v, penalty_key=p, segment_ids=seg)

    def fwd_bwd(q, k, v, p, seg):
        def loss(q, k, v, p):
            o, (s, a) = fwd(q, k, v, p, seg)
            return jnp.sum(o.astype(jnp.float32) ** 2) + jnp.sum(s ** 2) + jnp.sum(a ** 2)
        return jax.value_and_grad(loss, argnums=(0, 1, 2, 3))(q, k, v, p)

    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
        compiled = jax.jit(fwd).lower(*specs).compile()
        text = compiled.as_text()
        assert "vla_penalty_fwd" in text and "delta_rule_fwd" in text
        cost = compiled.cost_analysis()
        cost = cost[0] if isinstance(cost, (list, tuple)) else cost
        assert cost["flops"] >= pallas_tpu.cost("forward", d, b * h, t, pallas_tpu.default_chunk(d)).flops
        text = jax.jit(fwd_bwd).lower(*specs).compile().as_text()
    for name in ("vla_penalty_fwd", "vla_penalty_bwd", "delta_rule_fwd", "delta_rule_bwd"):
        assert name in text, name
