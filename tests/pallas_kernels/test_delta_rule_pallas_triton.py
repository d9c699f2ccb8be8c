"""Pallas-Triton delta-rule kernel (pallas_kernels/delta_rule/pallas_triton.py).

CPU: the kernels in interpret mode against the float64 reference (outputs, final state and the custom-VJP
gradients of all six inputs), and lowering for CUDA (Triton's shape rules) without a GPU.
GPU (``-m gpu``, skipped elsewhere): the compiled kernels against the reference in float32 and bfloat16.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from delta_rule_cases import gdn2_inputs, rel_rms_err, x64
from mixerlab.pallas_kernels.delta_rule import pallas_triton, reference

NAMES = ("q", "k", "erase_key", "v", "log_decay", "initial_state")


def _documents(batch, length, boundaries):
    starts = np.isin(np.arange(length), boundaries).astype(np.int32)
    return jnp.asarray(np.tile(np.cumsum(starts), (batch, 1)).astype(np.int32))


def _args(inputs, dtype):
    return [inputs[n].astype(dtype) if n in ("q", "k", "erase_key", "v") else inputs[n].astype(jnp.float32)
            for n in NAMES]


def _reference(args, document, weights):
    """float64 outputs and gradients of Σ o⊙w_o + Σ S_T⊙w_S."""
    w_out, w_state = weights
    with x64():
        wide = [jnp.asarray(np.asarray(a, np.float64)) for a in args]

        def loss(*xs):
            out, state = reference.delta_rule_reference(*xs, document)
            return jnp.sum(out * w_out) + jnp.sum(state * w_state), (out, state)

        grads, (out, state) = jax.grad(loss, argnums=tuple(range(6)), has_aux=True)(*wide)
        return np.asarray(out), np.asarray(state), [np.asarray(g) for g in grads]


def _kernel(args, document, weights, *, interpret=True, **tiling):
    w_out, w_state = (jnp.asarray(w, jnp.float32) for w in weights)

    def loss(*xs):
        out, state = pallas_triton.run(*xs, document, interpret=interpret, **tiling)
        return jnp.sum(out.astype(jnp.float32) * w_out) + jnp.sum(state * w_state), (out, state)

    grads, (out, state) = jax.jit(jax.grad(loss, argnums=tuple(range(6)), has_aux=True))(*args)
    return out, state, grads


def _weights(seed, batch, length, heads, key_dim, value_dim):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(batch, length, heads, value_dim)), rng.normal(size=(batch, heads, key_dim, value_dim))


def _check(got, want, tol, grad_tol):
    out, state, grads = got
    ref_out, ref_state, ref_grads = want
    assert rel_rms_err(out, ref_out) <= tol, rel_rms_err(out, ref_out)
    assert rel_rms_err(state, ref_state) <= tol, rel_rms_err(state, ref_state)
    for name, g, r in zip(NAMES, grads, ref_grads):
        assert np.all(np.isfinite(np.asarray(g, np.float64))), name
        assert rel_rms_err(g, r) <= grad_tol, (name, rel_rms_err(g, r))


@pytest.mark.parametrize("chunk_size, leaf_size, boundaries, options", [
    (64, 8, [5, 40, 64, 100], {}),  # T = 110: padded, segments inside and on a chunk edge
    (32, 16, [], {"save_rhs": False}),  # the backward's B0 recomputes U, Y, Q̂⊙π, K⊙E, π_C from P
    (64, 16, [30, 64], {"save_matrices": False, "block_k": 16}),  # backward recomputes K1; 2 key blocks
])
def test_interpret_matches_reference_f32(chunk_size, leaf_size, boundaries, options):
    b, t, h, dk, dv = 1, 110, 2, 32, 16
    inputs = gdn2_inputs(0, b, t, h, dk, dv, dtype=np.float32)
    args = _args(inputs, jnp.float32)
    document = _documents(b, t, boundaries)
    weights = _weights(1, b, t, h, dk, dv)
    got = _kernel(args, document, weights, chunk_size=chunk_size, leaf_size=leaf_size, **options)
    _check(got, _reference(args, document, weights), tol=2e-6, grad_tol=1e-5)  # observed ≤ 1e-6


def _forward_alone_and_trained(interpret, dtype, b, t, h, dk, dv, fold_solve, strong_decay_heads=0):
    """(o, S_T) of a forward without backward (K2 ``scan_output``; with ``fold_solve`` after K1_intra_alone),
    of the training forward (K2 + K3), and of the float64 reference."""
    args = _args(gdn2_inputs(3, b, t, h, dk, dv, dtype=np.float32, strong_decay_heads=strong_decay_heads), dtype)
    document = _documents(b, t, [17, 64, 300])
    run = lambda *a, **o: pallas_triton.run(*a, document, chunk_size=32 if interpret else 64,  # noqa: E731
                                            leaf_size=8, interpret=interpret, **o)
    alone = jax.jit(lambda *a: run(*a, fold_solve=fold_solve))(*args)
    trained = jax.jit(lambda *a: jax.vjp(run, *a)[0])(*args)
    with x64():
        wide = reference.delta_rule_reference(*[jnp.asarray(np.asarray(a, np.float64)) for a in args], document)
    return alone, trained, wide


def test_interpret_forward_alone_equals_the_training_forward():
    """Without ``fold_solve`` the fused K2 of a forward alone computes K3's products with K3's roundings: the
    same output and final state, bit for bit (the training forward is checked against the float64 reference
    above)."""
    alone, trained, _ = _forward_alone_and_trained(True, jnp.float32, 2, 100, 2, 32, 32, fold_solve=False)
    for x, y in zip(alone, trained):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("dtype, tol, trained_tol", [(jnp.float32, 2e-6, 2e-6), (jnp.bfloat16, 1e-2, 1e-2)])
def test_interpret_folded_forward_alone_matches_the_reference(dtype, tol, trained_tol):
    """``fold_solve`` (the default): K1_intra_alone writes M P and Pᵀ(K⊙E), the scan reads V̂ and K̂⊙π, so Ũ is
    never formed — another association of the same products. Against the float64 reference and the training
    forward, odd T, packed documents, a strong-decay head (cuts below the chunk)."""
    alone, trained, wide = _forward_alone_and_trained(True, dtype, 1, 100, 2, 32, 16, fold_solve=True,
                                                      strong_decay_heads=1)
    for x, y, z in zip(alone, trained, wide):
        assert rel_rms_err(x, z) <= tol, rel_rms_err(x, z)  # observed f32 1.7e-7, bf16 2.8e-3 (training 2.9e-3)
        assert rel_rms_err(x, y) <= trained_tol, rel_rms_err(x, y)  # observed f32 5.1e-8, bf16 2.5e-3


# bf16 is extended: the same passes and flags as f32 (the flags come from the float32 decays either way); bf16
# operands through K1 and the backward are checked against the reference by test_interpret_bf16_gradients_*
@pytest.mark.parametrize("dtype", [jnp.float32, pytest.param(jnp.bfloat16, marks=pytest.mark.extended)])
def test_interpret_two_passes_equal_one(dtype):
    """``two_pass`` (the default): the whole-chunk pass, then the search pass for the chunks it flagged, give
    the one-pass kernel's numbers bit for bit (interpret mode: the same products in the same order), forward
    alone and forward + backward (K1 and B2b), on a strong-decay head (flagged chunks) beside an ordinary one
    (unflagged)."""
    b, t, h, dk, dv = 1, 130, 2, 32, 16
    args = _args(gdn2_inputs(14, b, t, h, dk, dv, dtype=np.float32, strong_decay_heads=1), dtype)
    document = _documents(b, t, [40, 64])
    weights = _weights(15, b, t, h, dk, dv)
    got = {two: _kernel(args, document, weights, chunk_size=64, leaf_size=8, two_pass=two) for two in (False, True)}
    alone = {two: jax.jit(lambda *a, two=two: pallas_triton.run(*a, document, chunk_size=64, leaf_size=8,
                                                                 interpret=True, two_pass=two))(*args)
             for two in (False, True)}
    for x, y in zip(jax.tree.leaves((got[True], alone[True])), jax.tree.leaves((got[False], alone[False]))):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    flags = np.asarray(_first_pass_flags(args, document, dtype))
    assert flags[0, 0].any() and not flags[0, 1].any(), flags  # head 0 decays strongly, head 1 is ordinary


def _first_pass_flags(args, document, dtype):
    """The flags [B, H, N] of K1's first pass on ``args``, chunk 64."""
    from mixerlab.pallas_kernels import common
    b, t, h, dk = args[0].shape
    cfg = pallas_triton.make_config(64, 8, dk, args[3].shape[-1], dtype, batch_heads=b * h, interpret=True)
    padded = [common.pad_time(x, 64) for x in args[:5]]
    document = common.pad_time(document, 64, mode="edge")
    _, carried = common.chunk_documents(document, 64)
    _, flags = pallas_triton._intra(cfg, *padded, document, carried, with_inverse=False, with_flags=True)
    return flags


def test_interpret_strong_decay_is_finite_and_accurate():
    """λ ≈ −20 per token and channel (chunk-end Λ ≈ −1300): every exponent stays ≤ 0
    (docs/math/delta_rule.md, 'Boundary pivots')."""
    b, t, h, dk, dv = 1, 64, 2, 16, 16
    inputs = gdn2_inputs(2, b, t, h, dk, dv, dtype=np.float32, strong_decay_heads=1)
    args = _args(inputs, jnp.float32)
    document = _documents(b, t, [])
    weights = _weights(3, b, t, h, dk, dv)
    got = _kernel(args, document, weights, chunk_size=64, leaf_size=8)
    _check(got, _reference(args, document, weights), tol=1e-4, grad_tol=1e-4)


@pytest.mark.parametrize("per_token, span, cut", [
    (-1.0, 60.0, 6),  # half-chunk sums ≥ −32: the whole chunk through token 31
    (-2.5, 60.0, 5),  # −80 over 32 tokens, −40 over 16: nodes of 32
    (-20.0, 60.0, 2),  # −40 over 2 tokens: nodes of 4
    (-100.0, 60.0, 0),  # a single token decays by e^−100: the exact tree throughout
])
def test_bounded_cut_is_the_largest_node_whose_half_sums_fit_the_span(per_token, span, cut):
    cfg = pallas_triton.make_config(64, 16, 32, 32, jnp.float32, interpret=True, bounded_span=span)
    lam = jnp.full((64, 32), per_token, jnp.float32)
    parts = pallas_triton._split(lam, cfg)
    got, sums = jax.jit(lambda p: pallas_triton._bounded_cut(p, cfg, keep_sums=True))(parts)
    assert int(got) == cut == int(jax.jit(lambda p: pallas_triton._bounded_cut(p, cfg, keep_sums=False)[0])(parts))
    if cut:
        pairs, left, right = pallas_triton._pivot_factors(got, sums, parts, cfg)
        np.testing.assert_array_equal(right, pallas_triton._pivot_factors(got, None, parts, cfg)[2])
        cum = np.cumsum(np.full(64, per_token))
        i, j = np.tril_indices(64, -1)
        same_node = (i >> cut) == (j >> cut)
        np.testing.assert_array_equal(np.asarray(pairs)[i, j], same_node)
        decay = np.asarray(left)[i, 0] * np.asarray(right)[j, 0]  # e^{Λ_i − Λ_p} e^{Λ_p − Λ_j}
        np.testing.assert_allclose(decay[same_node], np.exp(cum[i] - cum[j])[same_node], rtol=1e-5, atol=1e-30)


def test_bad_bounded_span_names_the_valid_range():
    with pytest.raises(ValueError, match="bounded_span=100.*0, 80"):
        pallas_triton.make_config(64, 16, 32, 32, jnp.float32, bounded_span=100.0)


def test_interpret_float16_keeps_the_exact_tree():
    """float16 operands end at e^11: factors e^{±60} would overflow (NaN everywhere), so float16 runs the exact
    tree by default and refuses a span; forward and gradients stay within float16 error of the reference."""
    with pytest.raises(ValueError, match="float16"):
        pallas_triton.make_config(64, 16, 32, 32, jnp.float16, bounded_span=60.0)
    assert pallas_triton.make_config(64, 16, 32, 32, jnp.float16).bounded_span is None
    b, t, h, dk, dv = 1, 128, 2, 32, 32
    inputs = gdn2_inputs(4, b, t, h, dk, dv, dtype=np.float32)
    inputs["log_decay"] = 2.0 * inputs["log_decay"]  # half-chunk sums ≈ −50: the factored path would overflow
    args = _args(inputs, jnp.float16)
    document = _documents(b, t, [70])
    weights = _weights(5, b, t, h, dk, dv)
    got = _kernel(args, document, weights, chunk_size=64, leaf_size=16)
    _check(got, _reference(args, document, weights), tol=2e-3, grad_tol=5e-3)  # observed ≤ 9.3e-4


def test_interpret_bounded_and_tree_paths_agree_in_f32():
    """The factored path (default) and the exact tree on the same inputs, mixed cuts (one head with strong
    decay, one with ordinary gates): both within f32 rounding of the float64 reference."""
    b, t, h, dk, dv = 1, 128, 2, 32, 16
    inputs = gdn2_inputs(8, b, t, h, dk, dv, dtype=np.float32, strong_decay_heads=1)
    args = _args(inputs, jnp.float32)
    document = _documents(b, t, [5, 40, 64, 100])
    weights = _weights(9, b, t, h, dk, dv)
    want = _reference(args, document, weights)
    for span in (60.0, None):
        got = _kernel(args, document, weights, chunk_size=64, leaf_size=8, bounded_span=span)
        _check(got, want, tol=2e-6, grad_tol=1e-5)  # observed ≤ 1e-6 on both paths


# bf16 is extended: the exponent arithmetic is float32 for either operand dtype (f32 holds the tighter bound)
@pytest.mark.parametrize("dtype, tol, grad_tol", [(jnp.float32, 2e-6, 1e-5),
                                                  pytest.param(jnp.bfloat16, 1e-2, 2e-2, marks=pytest.mark.extended)])
def test_interpret_end_decays_by_difference(dtype, tol, grad_tol):
    """E's exponent as the chunk total minus π's (``end_decays="difference"``) against the float64 reference and
    against E's own decay sums, on a strong-decay head (chunk totals near −1300, where the difference loses the
    most) and packed documents."""
    b, t, h, dk, dv = 1, 130, 2, 32, 16
    args = _args(gdn2_inputs(14, b, t, h, dk, dv, dtype=np.float32, strong_decay_heads=1), dtype)
    document = _documents(b, t, [40, 64])
    weights = _weights(15, b, t, h, dk, dv)
    got = [_kernel(args, document, weights, chunk_size=64, leaf_size=8, end_decays=mode)
           for mode in ("difference", "sums")]
    _check(got[0], _reference(args, document, weights), tol=tol, grad_tol=grad_tol)  # observed f32 ≤ 1.3e-6
    for x, y in zip(jax.tree_util.tree_leaves(got[0]), jax.tree_util.tree_leaves(got[1])):
        assert rel_rms_err(x, y) <= 2e-6, rel_rms_err(x, y)  # observed ≤ 9.3e-7 (f32), ≤ 6.2e-7 (bf16)


def test_interpret_bf16_operands():
    b, t, h, dk, dv = 1, 64, 1, 32, 32
    inputs = gdn2_inputs(4, b, t, h, dk, dv, dtype=np.float32)
    args = _args(inputs, jnp.bfloat16)
    document = _documents(b, t, [20])
    out, state = jax.jit(lambda *a: pallas_triton.run(*a, document, chunk_size=64, leaf_size=8,
                                                      interpret=True))(*args)
    assert out.dtype == jnp.bfloat16 and state.dtype == jnp.float32
    ref_out, ref_state, _ = _reference(args, document, _weights(5, b, t, h, dk, dv))
    assert rel_rms_err(out, ref_out) <= 2e-2
    assert rel_rms_err(state, ref_state) <= 2e-2


def test_interpret_bf16_gradients_and_f32_pair_grads():
    """bf16 operands: all gradients within bf16 error of the reference on the same rounded inputs; the
    pivot-level matmuls of the key-gradient kernel in f32 (``pair_grads_f32``) make dλ clearly better."""
    b, t, h, dk, dv = 1, 128, 2, 64, 64
    inputs = gdn2_inputs(4, b, t, h, dk, dv, dtype=np.float32)
    args = _args(inputs, jnp.bfloat16)
    document = _documents(b, t, [70])
    weights = _weights(5, b, t, h, dk, dv)
    want = _reference(args, document, weights)
    errors = {}
    for wide in (False, True):
        got = _kernel(args, document, weights, chunk_size=64, leaf_size=16, pair_grads_f32=wide)
        _check(got, want, tol=1e-2, grad_tol=1.5e-2)
        errors[wide] = rel_rms_err(got[2][NAMES.index("log_decay")], want[2][NAMES.index("log_decay")])
    assert errors[True] < 0.6 * errors[False], errors  # observed 6.3e-3 -> 2.5e-3


def _call(**kw):
    base = dict(batch=2, length=4096, heads=16, key_dim=128, value_dim=128, dtype=jnp.dtype(jnp.bfloat16),
                has_erase=True, decay="channel", has_initial_state=True, has_segments=False, chunk_size=64,
                leaf_size=8, backend="gpu")
    base.update(kw)
    from mixerlab.pallas_kernels.delta_rule.api import DeltaRuleCall
    return DeltaRuleCall(**base)


def test_supports():
    assert pallas_triton.supports(_call()) is None
    assert pallas_triton.supports(_call(leaf_size=16)) is None
    assert pallas_triton.supports(_call(chunk_size=128, leaf_size=16)) is None
    for bad in (dict(backend="cpu"), dict(backend="tpu"), dict(chunk_size=256), dict(chunk_size=64, leaf_size=4),
                dict(key_dim=96), dict(value_dim=8), dict(key_dim=512), dict(dtype=jnp.dtype(jnp.float64))):
        reason = pallas_triton.supports(_call(**bad))
        assert isinstance(reason, str) and reason, bad


@pytest.mark.parametrize("chunk_size, leaf_size", [(64, 8), (64, 16)])
def test_lowers_for_cuda_on_cpu(chunk_size, leaf_size):
    """Forward and backward lower to Triton custom calls for CUDA (power-of-two blocks, supported ops)."""
    s = jax.ShapeDtypeStruct
    b, t, h, dk, dv = 1, 200, 2, 64, 32
    specs = [s((b, t, h, dk), jnp.bfloat16)] * 3 + [s((b, t, h, dv), jnp.bfloat16), s((b, t, h, dk), jnp.float32),
                                                   s((b, h, dk, dv), jnp.float32), s((b, t), jnp.int32)]

    def loss(*a):
        out, state = pallas_triton.run(*a, chunk_size=chunk_size, leaf_size=leaf_size)
        return jnp.sum(out.astype(jnp.float32)) + jnp.sum(state)

    grad = jax.grad(loss, argnums=tuple(range(6)))
    text = jax.jit(grad).trace(*specs).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 8
    # forward: intra (two passes), scan, output; backward (save_rhs: no rhs kernel): scan_bwd, cotangents,
    # key_grads (two passes)
    alone = jax.jit(loss).trace(*specs).lower(lowering_platforms=("cuda",)).as_text()
    assert alone.count("__gpu$xla.gpu.triton") == 3  # a forward alone: intra_alone (two passes), scan_output


@pytest.mark.parametrize("mode", ["tf32", "tf32x2"])
def test_decay_sum_parts_are_tf32_exact(mode):
    """The GPU path's λ parts: each exact in TF32 (low 13 mantissa bits zero), summing to λ within the
    stated error (tf32: 2⁻¹¹ relative, rounded to nearest; tf32x2: the TF32 rounding of lo, < 2⁻²⁰)."""
    cfg = pallas_triton.make_config(64, 16, 64, 64, jnp.bfloat16, decay_sums=mode)
    lam = -jnp.asarray(np.random.default_rng(0).exponential(2.0, size=(64, 32)), jnp.float32)
    parts = pallas_triton._split(lam, cfg)
    assert len(parts) == (1 if mode == "tf32" else 2)
    bits = np.asarray(jax.lax.bitcast_convert_type(parts[0], jnp.int32))
    assert np.all(bits & 8191 == 0)
    total = sum(np.asarray(p, np.float64) for p in parts)
    rel = np.abs(total - np.asarray(lam, np.float64)) / np.abs(np.asarray(lam, np.float64))
    assert rel.max() <= (2.0 ** -11 if mode == "tf32" else 1e-12), rel.max()
    if mode == "tf32":
        assert rel.max() > 2.0 ** -14  # really rounded (the check above can fail)


def test_config_defaults():
    cfg = pallas_triton.make_config(64, 8, 128, 128, jnp.bfloat16, batch_heads=8 * 16)
    assert cfg.scan_block_v == 64 and cfg.inverse_precision == "tf32" and cfg.levels == 6
    assert pallas_triton.make_config(64, 8, 128, 128, jnp.bfloat16, batch_heads=16).scan_block_v == 16
    assert dataclasses.replace(cfg, interpret=True).interpret
    assert cfg.block_k == 32 and cfg.save_matrices and cfg.resolved_decay_sums == "tf32"
    assert (cfg.stages_scan, cfg.stages_scan_output) == (2, 1)  # 8·16 heads × 2 value blocks = 256 programs
    assert pallas_triton.make_config(64, 8, 128, 128, jnp.bfloat16, batch_heads=16).stages_scan_output == 2
    assert cfg.end_decays == "sums"
    with pytest.raises(ValueError, match="end_decays='total'"):
        pallas_triton.make_config(64, 16, 128, 128, jnp.bfloat16, end_decays="total")
    assert pallas_triton.make_config(64, 16, 128, 128, jnp.float32).resolved_decay_sums == "tf32x2"
    with pytest.raises(ValueError, match="decay_sums"):
        pallas_triton.make_config(64, 16, 128, 128, jnp.float32, decay_sums="fp8")
    with pytest.raises(ValueError, match="block_k=48"):
        pallas_triton.make_config(64, 16, 128, 128, jnp.float32, block_k=48)


@pytest.mark.parametrize("setting, expected", [(None, "tf32"), ("default", "tf32"), ("tensorfloat32", "tf32"),
                                               ("highest", "highest"), ("float32", "highest")])
def test_f32_matmuls_follow_jax_matmul_precision(setting, expected):
    """A float32 run under jax.default_matmul_precision("float32") is float32 in the kernels too (as XLA's own
    matmuls are), one TF32 pass otherwise; the interpreter is always float32."""
    def made(**kw):
        return pallas_triton.make_config(64, 16, 128, 128, jnp.float32, **kw).inverse_precision

    if setting is None:
        assert made() == expected
    else:
        with jax.default_matmul_precision(setting):
            assert made() == expected
            assert made(inverse_precision="tf32") == "tf32"  # an explicit choice wins
    assert made(interpret=True) == "highest"


# ---------------------------------------------------------------------------------------------------------
# GPU only


gpu = pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a CUDA GPU")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype, tol, grad_tol, precision, leaf, options", [
    (jnp.float32, 1e-5, 1e-4, "highest", 16, {}), (jnp.float32, 3e-3, 1e-2, "tf32", 16, {}),
    (jnp.bfloat16, 2e-2, 5e-2, "tf32", 16, {}), (jnp.bfloat16, 2e-2, 5e-2, "tf32", 8, {}),
    (jnp.bfloat16, 2e-2, 5e-2, "tf32", 16, {"save_rhs": False})])
def test_gpu_matches_reference(dtype, tol, grad_tol, precision, leaf, options):
    b, t, h, dk, dv = 2, 512, 4, 128, 128
    inputs = gdn2_inputs(6, b, t, h, dk, dv, dtype=np.float32)
    args = _args(inputs, dtype)
    document = _documents(b, t, [100, 256, 300])
    weights = _weights(7, b, t, h, dk, dv)
    got = _kernel(args, document, weights, interpret=False, chunk_size=64, leaf_size=leaf,
                  inverse_precision=precision, **options)
    _check(got, _reference(args, document, weights), tol=tol, grad_tol=grad_tol)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("fold_solve", [False, True])
def test_gpu_forward_alone_matches_the_training_forward(fold_solve):
    """Without ``fold_solve``: the training forward's products and roundings; with it, within bf16 rounding of
    the training forward and the float64 reference."""
    alone, trained, wide = _forward_alone_and_trained(False, jnp.bfloat16, 2, 512, 4, 128, 128, fold_solve)
    for x, y, z in zip(alone, trained, wide):
        assert rel_rms_err(x, y) <= (1e-2 if fold_solve else 1e-6), rel_rms_err(x, y)
        assert rel_rms_err(x, z) <= 2e-2, rel_rms_err(x, z)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype, precision, between, tol, grad_tol", [
    (jnp.float32, "highest", 1e-5, 1e-5, 1e-4), (jnp.bfloat16, "tf32", 5e-3, 2e-2, 5e-2)])
def test_gpu_two_passes_match_one(dtype, precision, between, tol, grad_tol):
    """``two_pass`` compiled: with a strong-decay head (its chunks flagged, redone by the search pass) beside
    ordinary ones, forward + backward and a forward alone agree with the one-pass kernel (the whole-chunk pass
    adds its products in another order) and with the float64 reference."""
    b, t, h, dk, dv = 2, 512, 4, 128, 128
    args = _args(gdn2_inputs(6, b, t, h, dk, dv, dtype=np.float32, strong_decay_heads=1), dtype)
    document = _documents(b, t, [100, 256, 300])
    weights = _weights(7, b, t, h, dk, dv)
    got, alone = {}, {}
    for two in (False, True):
        got[two] = _kernel(args, document, weights, interpret=False, chunk_size=64, leaf_size=16,
                           inverse_precision=precision, two_pass=two)
        alone[two] = jax.jit(lambda *a, two=two: pallas_triton.run(*a, document, chunk_size=64, leaf_size=16,
                                                                    inverse_precision=precision, two_pass=two))(*args)
    for x, y in zip(jax.tree.leaves((got[True], alone[True])), jax.tree.leaves((got[False], alone[False]))):
        assert rel_rms_err(x, y) <= between, rel_rms_err(x, y)
    _check(got[True], _reference(args, document, weights), tol=tol, grad_tol=grad_tol)
