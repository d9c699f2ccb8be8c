"""Pallas TPU interdomain kernels (pallas_kernels/interdomain/pallas_tpu.py, pallas_tpu_bwd.py) without a TPU:

* interpret mode on CPU against the float64 token reference: outputs, both final states and the gradients of
  all nine float inputs through the custom VJPs (forward and backward kernels), relative RMS ≤ 1e-4 for
  float32 and ≤ 2e-2 for bfloat16; r ~ U[−20, 0] per token and mode, odd T, packed documents (a boundary
  mid-chunk and one on a chunk edge), an initial state; the S4D-only core (output kernels alone);
* the TPU interpreter's race detector on all four kernels;
* the declared CostEstimates against the traced kernel bodies, and how they scale;
* ``supports`` and the dispatch;
* real Mosaic compiles for TPU v5e, v6e and v5p through libtpu (forward, and forward + backward), marked
  ``tpu_compile``.
"""
from __future__ import annotations

import math
import os

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # pytest-xdist: two workers may load libtpu

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from jax.experimental.pallas import tpu as pltpu  # noqa: E402

from interdomain_cases import (NAMES, _executed, _inputs, _loss, _pallas_calls, _reference, _weights,  # noqa: E402
                               both_ops_loss, op_call)
from mixerlab.pallas_kernels.interdomain import api as ia  # noqa: E402
from mixerlab.pallas_kernels.interdomain import pallas_tpu, reference  # noqa: E402
from tpu_topologies import TOPOLOGIES, replicated, tpu_devices  # noqa: E402

F32_TOL = 1e-4
BF16_TOL = 2e-2
R_RANGE = (0.0, 20.0)  # r ~ −U[0, 20] per token and mode


def _rel_rms(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.sqrt(np.mean((a - b) ** 2)) / max(np.sqrt(np.mean(b ** 2)), 1e-300))


def _documents(t, boundaries_per_row):
    """Document index [B, T] with a different boundary set per batch row."""
    return jnp.asarray(np.stack([np.cumsum(np.isin(np.arange(t), bs)) for bs in boundaries_per_row]).astype(np.int32))


def _kernel(args, document, weights, dtype, *, chunk_size, interpret=True):
    cast = [jnp.asarray(a, dtype if i < 3 else jnp.float32) for i, a in enumerate(args)]
    shape = (*args[0].shape[:3], args[4].shape[-1])

    def fn(*x):
        return pallas_tpu.run(*x, document, chunk_size=chunk_size, interpret=interpret)

    loss = _loss(fn, [jnp.asarray(w, jnp.float32) for w in weights], shape)
    grads, outs = jax.jit(jax.grad(loss, argnums=tuple(range(9)), has_aux=True))(*cast)
    return list(outs), list(grads)


def _errors(got, want):
    (outs, grads), (ref_outs, ref_grads) = got, want
    errors = {n: _rel_rms(x, y) for n, x, y in zip(("o", "key", "value"), outs, ref_outs)}
    for name, g, r in zip(NAMES, grads, ref_grads):
        assert np.all(np.isfinite(np.asarray(g, np.float64))), name
        errors["d_" + name] = _rel_rms(g, r)
    return errors


def _assert_within(errors, tol):
    bad = {n: e for n, e in errors.items() if not e <= tol}
    assert not bad, f"relative RMS above {tol}: {bad} (all: {errors})"


# ---------------------------------------------------------------------------------------------------------
# interpret mode vs float64


@pytest.fixture(scope="module")
def packed_case():
    """C = 32, T = 75 (padded to 96), B = 2 rows with different documents (row 0: boundaries at 20 and at the
    chunk edge 32; row 1: one at 50), H = 2, R = 16 ≠ Dv = 32, M = 16, r ~ U[−20, 0] per token and mode, an
    initial state; q, k, v rounded to bf16 values so that the f32 and bf16 kernels share one float64 reference."""
    b, t, h, r, dv, m = 2, 75, 2, 16, 32, 16
    args, _ = _inputs(0, b, t, h, r, dv, m, log_modulus=R_RANGE)
    args = [np.asarray(jnp.asarray(a, jnp.bfloat16), np.float64) if i < 3 else a for i, a in enumerate(args)]
    document = _documents(t, [(20, 32), (50,)])
    weights = _weights(1, b, t, h, r, dv, m)
    return args, document, weights, _reference(args, document, weights)


def test_float32_matches_float64_segments_odd_length(packed_case):
    """Outputs, both final states and all nine gradients within 1e-4 relative RMS of float64."""
    args, document, weights, want = packed_case
    _assert_within(_errors(_kernel(args, document, weights, jnp.float32, chunk_size=32), want), F32_TOL)


def test_bfloat16_operands(packed_case):
    """bf16 q, k, v on the MXU (f32 accumulation, decays and states): every output and gradient within 2e-2
    relative RMS of float64 on the same inputs; o and the q, k, v gradients come back in bf16."""
    args, document, weights, want = packed_case
    got = _kernel(args, document, weights, jnp.bfloat16, chunk_size=32)
    assert got[0][0].dtype == jnp.bfloat16 and got[0][1].dtype == jnp.float32
    assert all(g.dtype == jnp.bfloat16 for g in got[1][:3])
    _assert_within(_errors(got, want), BF16_TOL)


@pytest.mark.extended  # the C = 32 f32 test covers the same kernels and numerics at a fraction of the cost
def test_float32_default_chunk_static_decay_head_dims_64():
    """The op's default chunk (64) and the 125M head shape (R = Dv = M = 64), static S4D decay, T = 100."""
    b, t, h, r, dv, m = 1, 100, 1, 64, 64, 64
    args, document = _inputs(6, b, t, h, r, dv, m, boundaries=(64, 70), selective=False)
    weights = _weights(7, b, t, h, r, dv, m)
    errors = _errors(_kernel(args, document, weights, jnp.float32, chunk_size=64),
                     _reference(args, document, weights))
    _assert_within(errors, F32_TOL)


@pytest.mark.extended  # the output kernels it runs are covered by the interdomain tests in make test
def test_s4d_core_matches_float64():
    """The S4D-only core on the output kernel pair alone (ω fixed per head): f32, T = 45, C = 32, r ~ U[−20, 0],
    documents with a boundary on the chunk edge, an initial state: output, final state and all six gradients."""
    b, t, h, c, m = 1, 45, 2, 16, 16
    args, _ = _inputs(10, b, t, h, c, c, m, log_modulus=R_RANGE)
    document = _documents(t, [(32, 40)])
    rng = np.random.default_rng(11)
    s4d_args = [args[1], args[3], args[4], args[5], rng.standard_normal((h, 2 * m)), args[7]]  # z, r, θ, b, ω, X₀
    w_out, w_state = rng.standard_normal((b, t, h, c)), rng.standard_normal((b, h, 2 * m, c))

    def grads_of(fn, xs, wide):
        def loss(*x):
            o, state = fn(*x)
            return jnp.sum(o.astype(wide) * w_out) + jnp.sum(state * w_state), (o, state)
        return jax.jit(jax.grad(loss, argnums=tuple(range(6)), has_aux=True))(*xs)

    with jax.enable_x64(True):
        ref_grads, ref_outs = grads_of(lambda *x: reference.s4d_reference(*x, document),
                                       [jnp.asarray(a, jnp.float64) for a in s4d_args], jnp.float64)
        ref_grads, ref_outs = [np.asarray(g) for g in ref_grads], [np.asarray(o) for o in ref_outs]
    grads, outs = grads_of(lambda *x: pallas_tpu.run_s4d(*x, document, chunk_size=32, interpret=True),
                           [jnp.asarray(a, jnp.float32) for a in s4d_args], jnp.float32)
    errors = {n: _rel_rms(x, y) for n, x, y in zip(("o", "state"), outs, ref_outs)}
    errors.update({"d_" + n: _rel_rms(x, y) for n, x, y in
                   zip(("z", "log_modulus", "phase", "input_gain", "readout", "state"), grads, ref_grads)})
    _assert_within(errors, F32_TOL)


# ---------------------------------------------------------------------------------------------------------
# race detector


def test_no_races_in_the_four_kernels():
    """TPU interpret mode with race detection (simulated HBM/VMEM/DMAs) on each kernel's pallas_call, run
    directly on random inputs in the kernels' layout (1 head x 2 chunks of 32, two documents)."""
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call as tpu_interpret

    from mixerlab.pallas_kernels.interdomain import pallas_tpu_bwd

    bh, t, d, m, chunk = 1, 64, 16, 16, 32
    cfg = pallas_tpu.KernelConfig(chunk, d, d, m, 1, "float32", pltpu.InterpretParams(detect_races=True))
    rng = np.random.default_rng(12)
    normal = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)  # noqa: E731
    tok, modes, state = normal(bh, t, d), normal(bh, t, m), normal(bh, t // chunk, 2 * m, d)
    r = -jnp.asarray(rng.uniform(0.0, 20.0, (bh, t, m)), jnp.float32)
    params = normal(1, 3, m)
    doc_col, doc_row = pallas_tpu.relative_documents(jnp.asarray((np.arange(t) >= 40)[None].astype(np.int32)),
                                                     chunk, t)
    a_re, a_im, scores = pallas_tpu._query_call(cfg, tok, tok, r, params, state, doc_col, doc_row, save_scores=True)
    o, pairs = pallas_tpu._output_call(cfg, modes, modes, tok, r, params, state, doc_col, doc_row, save_pairs=True)
    dq = pallas_tpu_bwd.query_bwd_call(cfg, tok, tok, r, params, state, doc_col, doc_row, scores, modes, modes)
    dw = pallas_tpu_bwd.output_bwd_call(cfg, modes, modes, tok, r, params, state, doc_col, doc_row, pairs, tok)
    outs = jax.block_until_ready((a_re, a_im, o, *dq, *dw))
    assert tpu_interpret.races is not None
    assert not tpu_interpret.races.races_found
    assert all(np.all(np.isfinite(np.asarray(x))) for x in outs)


# ---------------------------------------------------------------------------------------------------------
# the declared CostEstimates count what the kernels issue


def _declared_and_executed(chunk, r, dv, m, t, b=1, h=2):
    z = jnp.zeros
    args = [z((b, t, h, r), jnp.bfloat16), z((b, t, h, r), jnp.bfloat16), z((b, t, h, dv), jnp.bfloat16),
            -jnp.ones((b, t, h, m)), z((h, m)), z((h, 2 * m)), z((h, 2 * m, 2 * m)), z((b, h, 2 * m, r)),
            z((b, h, 2 * m, dv)), z((b, t), jnp.int32)]

    def loss(*a):
        return jnp.sum(pallas_tpu.run(*a, chunk_size=chunk)[0].astype(jnp.float32))

    calls = list(_pallas_calls(jax.make_jaxpr(jax.grad(loss, argnums=tuple(range(9))))(*args).jaxpr))
    out = {}
    for eqn in calls:
        name = eqn.params["name"].removeprefix("interdomain_tpu_")
        steps = math.prod(eqn.params["grid_mapping"].grid)
        out[name] = (eqn.params["cost_estimate"], steps, _executed(eqn.params["jaxpr"]))
    return out


@pytest.mark.parametrize("chunk, r, dv, m", [(64, 64, 64, 64), (32, 16, 32, 16)])
def test_cost_estimates_count_the_issued_work(chunk, r, dv, m):
    """Each of the four pallas_calls declares exactly the matmul FLOPs and exp/cos/sin elements its body issues
    (traced, not run) times the grid; bytes are positive and at least the per-token inputs and outputs."""
    found = _declared_and_executed(chunk, r, dv, m, t=2 * chunk)
    assert sorted(found) == ["output", "output_bwd", "query", "query_bwd"], sorted(found)
    for name, (est, steps, (flops, transcendentals)) in found.items():
        assert steps == 2 * 2  # B·H x N
        assert (est.flops, est.transcendentals) == (steps * flops, steps * transcendentals), name
        assert est.flops > 0 and est.transcendentals > 0
        assert est.bytes_accessed >= steps * chunk * 2 * (r + dv), name


def test_cost_estimates_scale_with_tokens_and_chunk():
    """Twice the tokens: twice every estimate; the per-token FLOPs grow with the chunk (the pivot tree's
    [K, K] GEMMs: K·log K per token, so C = 64 costs more than C = 32 per token)."""
    small = _declared_and_executed(32, 16, 16, 16, t=64)
    large = _declared_and_executed(32, 16, 16, 16, t=128)
    for name in small:
        a, b = small[name][0], large[name][0]
        assert (2 * a.flops, 2 * a.transcendentals, 2 * a.bytes_accessed) == (
            b.flops, b.transcendentals, b.bytes_accessed), name
    cfg = lambda c: pallas_tpu.KernelConfig(c, 64, 64, 64, 1, "bfloat16")  # noqa: E731
    for name in ("query", "output", "query_bwd", "output_bwd"):
        per_token = [pallas_tpu.kernel_counts(cfg(c))[name][0] / c for c in (32, 64, 128)]
        assert per_token[0] < per_token[1] < per_token[2], (name, per_token)


# ---------------------------------------------------------------------------------------------------------
# supports and dispatch


def _call(**kw):
    return op_call(**{"backend": "tpu", **kw})


def test_supports():
    assert pallas_tpu.supports(_call()) is None
    assert pallas_tpu.supports(_call(dtype=jnp.dtype(jnp.float32), chunk_size=32, modes=16, key_dim=128)) is None
    assert pallas_tpu.supports(_call(op="s4d", key_dim=0, value_dim=128)) is None
    for bad, needle in ((dict(backend="cpu"), "TPU backend"), (dict(backend="gpu"), "TPU backend"),
                        (dict(op="vla"), "'vla'"), (dict(chunk_size=48), "chunk_size=48"),
                        (dict(chunk_size=256), "chunk_size=256"), (dict(key_dim=96), "key_dim=96"),
                        (dict(value_dim=8), "value_dim=8"), (dict(modes=256), "modes=256"),
                        (dict(dtype=jnp.dtype(jnp.float64)), "float64"), (dict(dtype=jnp.dtype(jnp.float16)),
                                                                          "float16")):
        reason = pallas_tpu.supports(_call(**bad))
        assert isinstance(reason, str) and needle in reason, (bad, reason)


def test_dispatch_auto_takes_the_kernel_on_tpu_only():
    assert ia.TABLE.choose("auto", _call()).name == "pallas_tpu"
    assert ia.S4D_TABLE.choose("auto", _call(op="s4d", key_dim=0)).name == "pallas_tpu"
    assert ia.TABLE.choose("auto", _call(chunk_size=48)).name == "xla"  # refused: falls back
    assert ia.TABLE.choose("auto", _call(backend="cpu")).name == "xla"
    assert ia.TABLE.choose("auto", _call(backend="gpu")).name == "xla"  # the Triton kernel stays opt-in
    args, _ = _inputs(0, 1, 20, 2, 16, 16, 16)
    x = [jnp.asarray(a, jnp.float32) for a in args]
    with pytest.raises(ValueError, match="pallas_tpu.*needs a TPU backend"):
        ia.interdomain(*x[:3], log_modulus=x[3], phase=x[4], input_gain=x[5], readout=x[6],
                       implementation="pallas_tpu")


def test_run_rejects_unsupported_shapes_by_name():
    x = jnp.zeros((1, 8, 1, 16), jnp.float32)
    m = 16
    args = (x, x, x, jnp.zeros((1, 8, 1, m)), jnp.zeros((1, m)), jnp.zeros((1, 2 * m)), jnp.zeros((1, 2 * m, 2 * m)),
            jnp.zeros((1, 1, 2 * m, 16)), jnp.zeros((1, 1, 2 * m, 16)), jnp.zeros((1, 8), jnp.int32))
    with pytest.raises(ValueError, match="chunk_size=16 not in"):
        pallas_tpu.run(*args, chunk_size=16)
    with pytest.raises(ValueError, match="float16"):
        pallas_tpu.run(*(a.astype(jnp.float16) if i < 3 else a for i, a in enumerate(args)), chunk_size=32)


# ---------------------------------------------------------------------------------------------------------
# real compiles through libtpu (no TPU needed)

def _compile(gen, chunk, r, dv, m, dtype, backward, *, batch=1, length=64, heads=2):
    rep = replicated(gen)
    sd = lambda s, d=jnp.float32: jax.ShapeDtypeStruct(s, d, sharding=rep)  # noqa: E731
    x = (batch, length, heads)
    specs = [sd(x + (r,), dtype), sd(x + (r,), dtype), sd(x + (dv,), dtype), sd(x + (m,)), sd((heads, m)),
             sd((heads, 2 * m)), sd((heads, 2 * m, 2 * m)), sd((batch, heads, 2 * m, r)),
             sd((batch, heads, 2 * m, dv)), sd((batch, length), jnp.int32)]

    def fwd(*a):
        return pallas_tpu.run(*a, chunk_size=chunk)

    if backward:
        def fn(*a):
            def loss(*xs):
                o, key, value = fwd(*xs, a[-1])
                return jnp.sum(o.astype(jnp.float32) ** 2) + jnp.sum(key ** 2) + jnp.sum(value ** 2)
            return jax.value_and_grad(loss, argnums=tuple(range(9)))(*a[:-1])
    else:
        fn = fwd
    return jax.jit(fn).lower(*specs).compile()


@pytest.mark.tpu_compile
@pytest.mark.parametrize("gen", list(TOPOLOGIES))
def test_compiles_default_config(gen):
    """The op's default chunk (64) at the 125M head shape (R = Dv = M = 64), bf16: forward alone (its cost
    analysis includes the two kernels' declared estimates) and forward + backward."""
    compiled = _compile(gen, 64, 64, 64, 64, jnp.bfloat16, backward=False)
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    cfg = pallas_tpu.KernelConfig(64, 64, 64, 64, 2, "bfloat16")
    declared = sum(pallas_tpu.cost(cfg, name, 2).flops for name in ("query", "output"))
    assert cost["flops"] >= declared
    _compile(gen, 64, 64, 64, 64, jnp.bfloat16, backward=True)


@pytest.mark.tpu_compile
@pytest.mark.extended  # the default-config compiles for every generation stay in make test
@pytest.mark.parametrize("gen", list(TOPOLOGIES))
@pytest.mark.parametrize("chunk, r, dv, m, dtype", [(128, 128, 128, 128, jnp.float32), (32, 16, 32, 16, jnp.bfloat16)])
def test_compiles_other_configs(gen, chunk, r, dv, m, dtype):
    """The largest tiles (C = M = 128, f32 operands) and the smallest (C = 32, 16-wide dims): fwd + bwd."""
    _compile(gen, chunk, r, dv, m, dtype, backward=True)


@pytest.mark.tpu_compile
@pytest.mark.extended  # one whole-op program; the kernels' own compiles stay in make test
def test_ops_take_the_kernels_under_a_tpu_mesh_and_compile():
    """``interdomain`` and ``s4d`` with implementation "auto", traced under a v5e (data 2 × tensor 2) mesh as the
    trainer traces its step: both ops pick pallas_tpu (per shard through shard_map), and their gradient compiles;
    the program holds the interdomain op's four kernels and the S4D op's two output kernels."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    mesh = Mesh(np.array(tpu_devices("v5e")[:4]).reshape(2, 2), ("data", "tensor"))
    b, t, h, d, m = 4, 128, 4, 64, 64
    tokens, rows, rep = (NamedSharding(mesh, P("data", None, "tensor", None)), NamedSharding(mesh, P("data", None)),
                         NamedSharding(mesh, P()))
    sd = lambda s, dt=jnp.float32, sh=rep: jax.ShapeDtypeStruct(s, dt, sharding=sh)  # noqa: E731
    # a selective (per-token) log-modulus: for a static one "auto" takes the Toeplitz form (plain XLA)
    specs = [sd((b, t, h, d), jnp.bfloat16, tokens)] * 3 + [sd((b, t, h, m), sh=tokens), sd((h, m)),
                                                             sd((h, 2 * m)), sd((h, 2 * m, 2 * m)),
                                                             sd((b, t), jnp.int32, rows)]

    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
        lowered = jax.jit(jax.grad(both_ops_loss, argnums=(0, 1, 2, 4, 5, 6))).trace(*specs).lower()
    assert lowered.as_text().count("tpu_custom_call") == 6
    lowered.compile()
