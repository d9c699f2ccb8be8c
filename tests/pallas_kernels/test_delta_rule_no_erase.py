"""The no-erase specialisation of the delta-rule implementations (erase_key=None: k̂ = 0, (I + A)⁻¹ = I): outputs,
final state and the gradients of q, k, v, log_decay (per channel and per head) and the initial state against the
float64 reference, on odd lengths and packed documents (an id used again), in float32 and bfloat16; and proof that
the specialised path runs (no solve in the kernels' cost estimates and jaxprs).

Triton kernels run in interpret mode (small shapes: interpret mode is slow on the CPU)."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from delta_rule_cases import gdn2_inputs, rel_rms_err, x64
from mixerlab.pallas_kernels import common
from mixerlab.pallas_kernels.delta_rule import flops_gpu, pallas_triton, reference

NAMES = ("q", "k", "v", "log_decay", "initial_state")
# packed documents 0 | 1 | 0 | 2: id 0 comes back after another document (a new document)
SEGMENT_LENGTHS = (13, 31, 20, 11)  # T = 75: not a multiple of any chunk


def _segment_ids(batch):
    ids = np.concatenate([np.full(n, i, np.int32) for i, n in zip((0, 1, 0, 2), SEGMENT_LENGTHS)])
    return jnp.asarray(np.tile(ids, (batch, 1)))


def _case(seed, batch, heads, key_dim, value_dim, decay, dtype, strong_decay_heads=0):
    """(args in the kernel's dtypes, document index, loss weights); λ [B, T, H] for decay="head"."""
    t = sum(SEGMENT_LENGTHS)
    inputs = gdn2_inputs(seed, batch, t, heads, key_dim, value_dim, dtype=np.float32, decay=decay, erase=False,
                         strong_decay_heads=strong_decay_heads)
    args = [inputs[n].astype(dtype) if n in ("q", "k", "v") else inputs[n].astype(jnp.float32) for n in NAMES]
    document = common.document_index(_segment_ids(batch), batch, t)
    rng = np.random.default_rng(seed + 1)
    weights = rng.normal(size=(batch, t, heads, value_dim)), rng.normal(size=(batch, heads, key_dim, value_dim))
    return args, document, weights


def _channel(log_decay, key_dim):
    """[B, T, H] → [B, T, H, Dk] as the op broadcasts it (the gradient sums over the channels)."""
    if log_decay.ndim == 3:
        return jnp.broadcast_to(log_decay[..., None], (*log_decay.shape, key_dim))
    return log_decay


def _reference(args, document, weights):
    w_out, w_state = weights
    with x64():
        wide = [jnp.asarray(np.asarray(a, np.float64)) for a in args]

        def loss(q, k, v, log_decay, state):
            out, final = reference.delta_rule_reference(q, k, jnp.zeros_like(k), v, _channel(log_decay, k.shape[-1]),
                                                        state, document)
            return jnp.sum(out * w_out) + jnp.sum(final * w_state), (out, final)

        grads, (out, final) = jax.grad(loss, argnums=tuple(range(5)), has_aux=True)(*wide)
        return np.asarray(out), np.asarray(final), [np.asarray(g) for g in grads]


def _check(got, want, tol, grad_tol):
    out, final, grads = got
    ref_out, ref_final, ref_grads = want
    assert rel_rms_err(out, ref_out) <= tol, rel_rms_err(out, ref_out)
    assert rel_rms_err(final, ref_final) <= tol, rel_rms_err(final, ref_final)
    for name, g, r in zip(NAMES, grads, ref_grads):
        assert g.shape == r.shape, name
        assert np.all(np.isfinite(np.asarray(g, np.float64))), name
        assert rel_rms_err(g, r) <= grad_tol, (name, rel_rms_err(g, r))


# ---------------------------------------------------------------------------------------------------------
# Pallas-Triton (interpret mode)


def _triton(args, document, weights, **tiling):
    w_out, w_state = (jnp.asarray(w, jnp.float32) for w in weights)

    def loss(q, k, v, log_decay, state):
        out, final = pallas_triton.run(q, k, None, v, _channel(log_decay, k.shape[-1]), state, document,
                                       interpret=True, **tiling)
        return jnp.sum(out.astype(jnp.float32) * w_out) + jnp.sum(final * w_state), (out, final)

    grads, (out, final) = jax.jit(jax.grad(loss, argnums=tuple(range(5)), has_aux=True))(*args)
    return out, final, grads


@pytest.mark.parametrize("dtype, decay, tiling, tol, grad_tol", [
    # observed (rel. RMS): f32 ≤ 5.2e-7 (outputs, state, gradients); bf16 ≤ 2.8e-3 (outputs), ≤ 5.9e-3 (gradients)
    (jnp.float32, "channel", dict(chunk_size=32, leaf_size=16), 2e-6, 1e-5),
    (jnp.float32, "head", dict(chunk_size=32, leaf_size=8, save_matrices=False, block_k=16), 2e-6, 1e-5),
    (jnp.bfloat16, "channel", dict(chunk_size=32, leaf_size=16), 1e-2, 2e-2),
    (jnp.float32, "channel", dict(chunk_size=32, leaf_size=16, bounded_span=None), 2e-6, 1e-5),  # exact tree
])
def test_triton_no_erase_matches_reference(dtype, decay, tiling, tol, grad_tol):
    args, document, weights = _case(0, 1, 2, 32, 16, decay, dtype)
    _check(_triton(args, document, weights, **tiling), _reference(args, document, weights), tol, grad_tol)


@pytest.mark.slow  # 17 s on the loaded 2-core machine (two interpret-mode K1 passes and the backward)
def test_triton_no_erase_strong_decay_takes_the_search_pass():
    """A head with λ ≈ −20 per token: K1's whole-chunk pass flags its chunks and the no-erase search pass (the cut
    search and the exact pivot levels, M alone) redoes them; outputs and gradients stay accurate and finite."""
    args, document, weights = _case(3, 1, 2, 32, 16, "channel", jnp.float32, strong_decay_heads=1)
    q, k, v, log_decay, _ = args
    _, carry = common.chunk_documents(common.pad_time(document, 32, mode="edge"), 32)
    cfg = pallas_triton.make_config(32, 16, 32, 16, jnp.float32, batch_heads=2, interpret=True, has_erase=False)
    padded = [common.pad_time(x, 32) for x in (q, k, log_decay)]
    _, flags = pallas_triton._intra_plain(cfg, *padded, common.pad_time(document, 32, mode="edge"), carry, True,
                                          with_flags=True)
    assert np.asarray(flags)[:, 0].all() and not np.asarray(flags)[:, 1].any()  # the strong head, only
    _check(_triton(args, document, weights, chunk_size=32, leaf_size=16), _reference(args, document, weights),
           2e-6, 1e-5)


@pytest.mark.parametrize("dtype, tol", [(jnp.float32, 2e-6), (jnp.bfloat16, 1e-2)])
def test_triton_no_erase_forward_alone(dtype, tol):
    """A forward without backward: K1 and the fused scan_output (no solve to fold), against the reference."""
    args, document, weights = _case(2, 1, 2, 32, 16, "channel", dtype)
    q, k, v, log_decay, state = args
    out, final = jax.jit(lambda *a: pallas_triton.run(a[0], a[1], None, *a[2:], document, chunk_size=32,
                                                      leaf_size=16, interpret=True))(q, k, v, log_decay, state)
    ref_out, ref_final, _ = _reference(args, document, weights)
    assert rel_rms_err(out, ref_out) <= tol and rel_rms_err(final, ref_final) <= tol


def _executed_flops(jaxpr, scale=1):
    """Matmul FLOPs of one program of a kernel jaxpr (loop bodies × trip count; while loops: the condition)."""
    flops = 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            (contract, _), _ = eqn.params["dimension_numbers"]
            lhs = eqn.invars[0].aval.shape
            flops += scale * 2 * math.prod(eqn.outvars[0].aval.shape) * math.prod(lhs[d] for d in contract)
        inner = scale * (eqn.params["length"] if eqn.primitive.name == "scan" else 1)
        if eqn.primitive.name == "while":
            flops += _executed_flops(eqn.params["cond_jaxpr"].jaxpr, scale)
            continue
        for value in eqn.params.values():
            sub = getattr(value, "jaxpr", value)
            if hasattr(sub, "eqns"):
                flops += _executed_flops(sub, inner)
    return flops


def _pallas_calls(fn, *args):
    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "pallas_call":
                yield eqn
                continue
            for value in eqn.params.values():
                sub = getattr(value, "jaxpr", value)
                if hasattr(sub, "eqns"):
                    yield from walk(sub)

    return list(walk(jax.make_jaxpr(fn)(*args).jaxpr))


def _triton_calls(erase, with_backward, dtype=jnp.bfloat16):
    """The pallas_calls of the Triton forward (+ backward), traced (interpret=False: nothing is lowered)."""
    b, t, h, dk, dv, c = 1, 128, 2, 64, 64, 64
    rng = jax.random.split(jax.random.PRNGKey(0), 4)
    q, k, e = (jax.random.normal(r, (b, t, h, dk), dtype) for r in rng[:3])
    v = jax.random.normal(rng[3], (b, t, h, dv), dtype)
    lam = -jnp.ones((b, t, h, dk), jnp.float32)
    state = jnp.zeros((b, h, dk, dv), jnp.float32)
    doc = jnp.zeros((b, t), jnp.int32)

    def forward(q, k, e, v, lam, state):
        out, final = pallas_triton.run(q, k, e if erase else None, v, lam, state, doc, chunk_size=c, leaf_size=16)
        return jnp.sum(out.astype(jnp.float32)) + jnp.sum(final)

    fn = jax.grad(forward, argnums=(0, 1, 2, 3, 4, 5)) if with_backward else forward
    return _pallas_calls(fn, q, k, e, v, lam, state), (b * h * t // c, c, dk, dv)


@pytest.mark.parametrize("with_backward", [True, False])
def test_triton_no_erase_runs_no_solve(with_backward):
    """Without an erase every kernel is the specialised one: each declares flops_gpu's no-erase count
    (``has_erase=False``), which equals the matmul FLOPs its traced body executes and has no inverse (K1's TF32
    FLOPs are the decay sums alone), and forward + backward execute fewer FLOPs than with an erase."""
    calls, (chunks, c, dk, dv) = _triton_calls(False, with_backward)
    counts = flops_gpu.kernel_counts(c, 16, dk, dv, 32, 1, True, 2, True, has_erase=False)
    kernel_of = {"delta_rule_intra": "K1_intra", "delta_rule_scan": "K2_scan", "delta_rule_output": "K3_output",
                 "delta_rule_scan_output": "K2_scan_output", "delta_rule_scan_bwd": "B1_scan_bwd",
                 "delta_rule_cotangents": "B2a_cotangents", "delta_rule_key_grads": "B2b_key_grads"}
    names = [eqn.params["name"] for eqn in calls]
    expected = (["delta_rule_intra", "delta_rule_intra_search", "delta_rule_scan", "delta_rule_output",
                 "delta_rule_scan_bwd", "delta_rule_cotangents", "delta_rule_key_grads", "delta_rule_key_grads_search"]
                if with_backward else ["delta_rule_intra", "delta_rule_intra_search", "delta_rule_scan_output"])
    assert names == expected
    total = 0
    for eqn in calls:
        if eqn.params["name"].endswith("_search"):
            continue
        est = eqn.params["cost_estimate"]
        programs = math.prod(eqn.params["grid_mapping"].grid)
        assert est.flops == programs * _executed_flops(eqn.params["jaxpr"]), eqn.params["name"]
        bf16, tf32, nbytes = counts[kernel_of[eqn.params["name"]]]
        assert est.flops == chunks * (bf16 + tf32), eqn.params["name"]
        total += est.flops
    # K1: the decay sums (π, E and the cut's factors: one TF32 pass each) and no inverse
    assert counts["K1_intra"][1] == 3 * 2 * c * c * dk
    with_erase = sum(eqn.params["cost_estimate"].flops for eqn in _triton_calls(True, with_backward)[0])
    assert total < with_erase, (total, with_erase)


def test_triton_no_erase_lowers_for_cuda_on_cpu():
    """The specialised kernels lower to Triton (shape rules, a scalar accumulator in place of A): 8 kernels for
    forward + backward, 3 for a forward alone."""
    s = jax.ShapeDtypeStruct
    b, t, h, dk, dv = 1, 200, 2, 64, 32
    specs = [s((b, t, h, dk), jnp.bfloat16)] * 2 + [s((b, t, h, dv), jnp.bfloat16), s((b, t, h, dk), jnp.float32),
                                                   s((b, h, dk, dv), jnp.float32), s((b, t), jnp.int32)]

    def loss(q, k, v, lam, state, doc):
        out, final = pallas_triton.run(q, k, None, v, lam, state, doc, chunk_size=64, leaf_size=16)
        return jnp.sum(out.astype(jnp.float32)) + jnp.sum(final)

    grad = jax.grad(loss, argnums=tuple(range(5)))
    assert jax.jit(grad).trace(*specs).lower(lowering_platforms=("cuda",)).as_text().count(
        "__gpu$xla.gpu.triton") == 8
    assert jax.jit(loss).trace(*specs).lower(lowering_platforms=("cuda",)).as_text().count(
        "__gpu$xla.gpu.triton") == 3


def test_flops_gpu_no_erase_counts_by_hand():
    c, d = 64, 128
    mm = lambda m, k, n: 2 * m * k * n  # noqa: E731
    plain = flops_gpu.kernel_counts(chunk=c, leaf=16, dk=d, dv=d, block_k=32, has_erase=False)
    full = flops_gpu.kernel_counts(chunk=c, leaf=16, dk=d, dv=d, block_k=32)
    assert plain["K1_intra"][:2] == (mm(c, d, c), 3 * mm(c, c, d))  # M's product; π, E and the factors' sums
    assert full["K1_intra"][1] - plain["K1_intra"][1] == 10 * mm(c, c, c)  # the inverse
    assert plain["K2_scan"][0] == mm(c, d, d) and plain["B2a_cotangents"][0] == mm(c, c, d)
    assert plain["B2b_key_grads"][0] == 2 * mm(c, d, d) + 2 * mm(c, c, d)
    assert "K1_intra_alone" not in plain and "B0_rhs" not in flops_gpu.kernel_counts(save_rhs=False, has_erase=False)
    assert all(sum(plain[n][:2]) < sum(full[n][:2]) for n in plain if n != "K3_output")
    assert plain["K3_output"] == full["K3_output"]
    assert flops_gpu.main(["--no-erase"]) == 0


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype, precision, tol, grad_tol", [
    (jnp.float32, "highest", 1e-5, 1e-4), (jnp.bfloat16, "tf32", 2e-2, 5e-2)])
def test_gpu_triton_no_erase_matches_reference(dtype, precision, tol, grad_tol):
    """The compiled no-erase kernels (the tolerances of the delta kernels' GPU test), T = 75 packed."""
    args, document, weights = _case(8, 2, 4, 128, 128, "channel", dtype)
    got = _triton_compiled(args, document, weights, inverse_precision=precision)
    _check(got, _reference(args, document, weights), tol, grad_tol)


def _triton_compiled(args, document, weights, **options):
    w_out, w_state = (jnp.asarray(w, jnp.float32) for w in weights)

    def loss(q, k, v, log_decay, state):
        out, final = pallas_triton.run(q, k, None, v, log_decay, state, document, chunk_size=64, leaf_size=16,
                                       **options)
        return jnp.sum(out.astype(jnp.float32) * w_out) + jnp.sum(final * w_state), (out, final)

    grads, (out, final) = jax.jit(jax.grad(loss, argnums=tuple(range(5)), has_aux=True))(*args)
    return out, final, grads

# ---------------------------------------------------------------------------------------------------------
# xla (through the op: api.delta_rule with erase_key=None)


def _op_inputs(seed, decay, dtype):
    t = sum(SEGMENT_LENGTHS)
    inputs = gdn2_inputs(seed, 2, t, 2, 16, 8, dtype=np.float32, decay=decay, erase=False)
    inputs = {n: None if x is None else (x.astype(dtype) if n in ("q", "k", "v") else x)
              for n, x in inputs.items()}
    rng = np.random.default_rng(seed + 1)
    weights = (jnp.asarray(rng.normal(size=(2, t, 2, 8)), jnp.float32),
               jnp.asarray(rng.normal(size=(2, 2, 16, 8)), jnp.float32))
    return inputs, weights


@pytest.mark.parametrize("dtype, decay, chunk, leaf, tol, grad_tol", [
    # computed in f32 either way; bf16 inputs get bf16 outputs and gradients (their rounding, 1.6e-3 observed)
    (jnp.float32, "channel", 32, 8, 2e-6, 1e-5),
    (jnp.float32, "head", 16, 4, 2e-6, 1e-5),
    (jnp.bfloat16, "channel", 32, 8, 5e-3, 5e-3),
])
def test_xla_no_erase_matches_reference(dtype, decay, chunk, leaf, tol, grad_tol):
    """The xla path's no-erase chunk (forward and custom VJP) against the float64 reference, on the same
    inputs (the bf16 ones widened exactly)."""
    from delta_rule_cases import as_float64, outputs_and_grads
    inputs, (w_out, w_state) = _op_inputs(4, decay, dtype)
    segments = _segment_ids(2)
    got = outputs_and_grads(inputs, w_out, w_state, segments, implementation="xla", chunk_size=chunk,
                            leaf_size=leaf)
    with x64():
        want = outputs_and_grads(as_float64(inputs), w_out.astype(jnp.float64), w_state.astype(jnp.float64),
                                 segments, implementation="reference")
    assert got[2]["erase_key"] is None
    _check((got[0], got[1], [got[2][n] for n in NAMES]), (want[0], want[1], [want[2][n] for n in NAMES]),
           tol, grad_tol)


def test_xla_no_erase_builds_no_inverse(monkeypatch):
    """Without an erase the xla forward and backward never build (I + A)⁻¹ (the recursive inverse is not
    called); with an erase key of zeros they do."""
    from delta_rule_cases import outputs_and_grads
    from mixerlab.pallas_kernels.delta_rule import xla

    def no_inverse(*args):
        raise AssertionError("recursive_inverse called")

    monkeypatch.setattr(xla, "recursive_inverse", no_inverse)
    inputs, (w_out, w_state) = _op_inputs(5, "channel", jnp.float32)
    # a fresh jit: traced afresh with the patched module (the shared one may hold a cached trace)
    run = jax.jit(outputs_and_grads.__wrapped__, static_argnames=("implementation", "chunk_size", "leaf_size"))
    out, final, grads = run(inputs, w_out, w_state, None, implementation="xla", chunk_size=16, leaf_size=4)
    assert np.all(np.isfinite(np.asarray(out))) and grads["erase_key"] is None
    with pytest.raises(AssertionError, match="recursive_inverse called"):
        run({**inputs, "erase_key": jnp.zeros_like(inputs["k"])}, w_out, w_state, None, implementation="xla",
            chunk_size=16, leaf_size=4)


# ---------------------------------------------------------------------------------------------------------
# Pallas TPU (interpret mode on the CPU; real Mosaic compiles through libtpu)


def _tpu(args, segments, chunk_size, leaf_size):
    def loss(q, k, v, log_decay, state):
        from mixerlab.pallas_kernels.delta_rule import pallas_tpu
        out, final = pallas_tpu.delta_rule_interpret(q, k, v, log_decay=log_decay, initial_state=state,
                                                     segment_ids=segments, chunk_size=chunk_size,
                                                     leaf_size=leaf_size)
        dt = final.dtype
        return jnp.sum(out.astype(dt) * w_out) + jnp.sum(final * w_state), (out, final)

    args, (w_out, w_state) = args
    grads, (out, final) = jax.jit(jax.grad(loss, argnums=tuple(range(5)), has_aux=True))(*args)
    return out, final, grads


@pytest.mark.parametrize("dtype, decay, tol, grad_tol", [
    # observed (rel. RMS): f32 ≤ 3.0e-7 (outputs, state, gradients); bf16 operands (bf16 MXU, bf16 outputs) ≤ 4.1e-3
    (jnp.float32, "channel", 2e-6, 1e-5),
    pytest.param(jnp.bfloat16, "head", 1e-2, 2e-2, marks=pytest.mark.slow),
])
def test_tpu_no_erase_matches_reference(dtype, decay, tol, grad_tol):
    """The no-erase TPU forward and backward kernels (interpret mode), C = 64, n0 = 8, d = 64, T = 75 with
    packed documents (an id used again), against the float64 reference."""
    args, document, weights = _case(7, 1, 1, 64, 64, decay, dtype)
    w = tuple(jnp.asarray(x, jnp.float32) for x in weights)
    got = _tpu((args, w), _segment_ids(1), 64, 8)
    _check(got, _reference(args, document, weights), tol, grad_tol)


def _tpu_kernel_calls(erase, chunk=128, leaf=16, dk=64, dv=128):
    from mixerlab.pallas_kernels.delta_rule import pallas_tpu
    b, t, h = 1, 2 * chunk, 2
    q = jnp.zeros((b, t, h, dk), jnp.bfloat16)
    v = jnp.zeros((b, t, h, dv), jnp.bfloat16)
    lam = jnp.zeros((b, t, h, dk), jnp.float32)
    s0 = jnp.zeros((b, h, dk, dv), jnp.float32)
    doc = jnp.zeros((b, t), jnp.int32)

    def loss(q, k, e, v, lam, s0):
        o, s = pallas_tpu.run(q, k, e if erase else None, v, lam, s0, doc, chunk_size=chunk, leaf_size=leaf)
        return jnp.sum(o.astype(jnp.float32)) + jnp.sum(s)

    return {eqn.params["name"]: eqn for eqn in
            _pallas_calls(jax.grad(loss, argnums=tuple(range(6))), q, q, q, v, lam, s0)}, pallas_tpu.Geometry(
        chunk, leaf, dk, dv)


def test_tpu_no_erase_kernels_run_no_solve():
    """Without an erase the TPU forward and backward are the no-erase kernels, whose declared FLOPs are the
    matmuls their bodies issue (traced), with no inverse, merge or solve: fewer than with an erase."""
    from mixerlab.pallas_kernels.delta_rule import pallas_tpu, pallas_tpu_bwd
    calls, g = _tpu_kernel_calls(False)
    assert set(calls) == {"delta_rule_fwd_no_erase", "delta_rule_bwd_no_erase"}
    for eqn in calls.values():
        steps = math.prod(eqn.params["grid_mapping"].grid)
        assert eqn.params["cost_estimate"].flops == steps * _executed_flops(eqn.params["jaxpr"]), eqn.params["name"]
    core = pallas_tpu.core_counts(g, breakdown=True, has_erase=False)
    assert not any("inverse" in stage or "merges" in stage or "solve" in stage for stage in core)
    full, _ = _tpu_kernel_calls(True)
    assert calls["delta_rule_fwd_no_erase"].params["cost_estimate"].flops < full["delta_rule_fwd"].params[
        "cost_estimate"].flops
    assert calls["delta_rule_bwd_no_erase"].params["cost_estimate"].flops < full["delta_rule_bwd"].params[
        "cost_estimate"].flops
    assert pallas_tpu_bwd.backward_counts(g, has_erase=False)[0] < pallas_tpu_bwd.backward_counts(g)[0]


@pytest.mark.tpu_compile
@pytest.mark.parametrize("gen", ["v5e", "v6e", "v5p"])
def test_tpu_no_erase_compiles(gen):
    """The no-erase forward + backward kernels compile through Mosaic (libtpu) at the default tiling (C = 256,
    n0 = 8, d = 128, bf16); the forward's cost_analysis is its declared estimate (+ the layout glue's integer
    ops on the document ids, ≤ 2 per token)."""
    from mixerlab.pallas_kernels.delta_rule import pallas_tpu
    from tpu_topologies import replicated
    rep = replicated(gen)
    sd = lambda s, d: jax.ShapeDtypeStruct(s, d, sharding=rep)  # noqa: E731
    b, t, h, dk, dv = 1, 512, 2, 128, 128
    specs = [sd((b, t, h, dk), jnp.bfloat16)] * 2 + [sd((b, t, h, dv), jnp.bfloat16), sd((b, t, h, dk), jnp.float32),
                                                    sd((b, h, dk, dv), jnp.float32), sd((b, t), jnp.int32)]

    def fwd(q, k, v, lam, s0, doc):
        return pallas_tpu.run(q, k, None, v, lam, s0, doc, chunk_size=256, leaf_size=8)

    def train(q, k, v, lam, s0, doc):
        def loss(q, k, v, lam, s0):
            o, s = fwd(q, k, v, lam, s0, doc)
            return jnp.sum(o.astype(jnp.float32) ** 2) + jnp.sum(s ** 2)
        return jax.value_and_grad(loss, argnums=tuple(range(5)))(q, k, v, lam, s0)

    cost = jax.jit(fwd).lower(*specs).compile().cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    expected = pallas_tpu.forward_cost(pallas_tpu.Geometry(256, 8, dk, dv), b * h, t // 256, 2, has_erase=False)
    assert 0 <= cost["flops"] - expected.flops <= 2 * t
    jax.jit(train).lower(*specs).compile()


# ---------------------------------------------------------------------------------------------------------
# the ideal-kernel FLOP model (pallas_kernels/delta_rule/flops.py)


def test_flops_model_no_erase():
    """KernelConfig(has_erase=False): forward MXU = the MXU cumsum + M's cross blocks (half the fused A/M
    product) + (Q̂⊙π) S₀ + M V̂ + the state update, per token and head; no Table 8 inverse/merge/solve rows."""
    from mixerlab.pallas_kernels.delta_rule import flops
    c, n0, dk, dv = 256, 8, 128, 128
    plain = flops.KernelConfig(c, n0, dk, dv, has_erase=False)
    full = flops.KernelConfig(c, n0, dk, dv)
    forward = flops.total(flops.forward_stages(plain)).mxu
    assert forward == 2 * c * dk + (c - n0) * dk + 2 * dk * dv + 2 * c * dv + 2 * dk * dv
    assert not any(stage.table8 for stage in flops.forward_stages(plain))
    for stages in (flops.forward_stages, flops.backward_stages):
        assert flops.total(stages(plain)).mxu < flops.total(stages(full)).mxu
        assert not any("solve" in s.name or "merges" in s.name for s in stages(plain))
    assert sum(flops.hbm_bytes(full, True).values()) - sum(flops.hbm_bytes(plain, True).values()) == 3 * 2 * dk
    assert flops.main(["--no-erase", "--backward"]) == 0
