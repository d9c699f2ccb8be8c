"""The project's one packing convention, for every op that takes ``segment_ids``: a document starts wherever the
id CHANGES from the previous position, so an id reused after another document (0,0,1,1,0,0) is a new document
(docs/architecture.md, 'Packing'). Each op runs rows with such non-monotone ids, odd lengths and documents
shorter than a chunk or a conv window, and must give what it gives on each document alone: outputs, and for the
recurrent ops the final state (that of the row's last document; an initial state belongs to the row's first
document only). Every implementation that runs on a CPU goes through the op's public entry, the kernels in
interpret mode (the op's table entry wrapped with ``interpret=True``), so the id-to-document step of the entry is
what is tested. A mask or reset that compared raw ids (seg[i] == seg[j]) would join the first and third
documents of row 0 and fail here by value."""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mixerlab.pallas_kernels import attention, delta_rule
from mixerlab.pallas_kernels.attention import api as attention_api
from mixerlab.pallas_kernels.attention import cudnn_packed
from mixerlab.pallas_kernels.delta_rule import api as delta_rule_api
from mixerlab.pallas_kernels.interdomain import api as ia
from mixerlab.pallas_kernels.short_conv import api as short_conv_api
from mixerlab.pallas_kernels.vla import api as vla_api

# (lengths, ids) per row: row 0 is 0…0 1…1 0…0 (the reused id), row 1 alternates two ids over five documents.
ROWS = (((4, 3, 6), (0, 1, 0)), ((2, 3, 2, 5, 1), (7, 3, 7, 3, 7)))
ONE_ROW = ROWS[:1]  # the chunked forms and kernels of the recurrent ops: each document alone is one more compile
T = 13  # odd: no chunk or block multiple. Inputs have both rows; a one-row layout uses row 0


def _kernels_extended(paths):
    """Parametrize over ``paths`` with the interpret-mode kernels extended (several passes each: 12–20 s on a
    loaded 2-core machine). For these recurrent ops the entry turns the ids into document numbers
    (``common.document_index``) before it picks an implementation, so the reference and xla variants in make test
    check that step; each kernel's own tests check its resets on packed documents shorter than a chunk."""
    return [pytest.param(n, marks=pytest.mark.extended) if n.startswith("pallas_") else n for n in paths]


def _segment_ids(rows=ROWS):
    return jnp.asarray(np.stack([np.repeat(ids, lengths) for lengths, ids in rows]), jnp.int32)


def _spans(rows=ROWS):
    """[(row, start, stop, is_first_of_row, is_last_of_row)] for every document."""
    out = []
    for row, (lengths, _) in enumerate(rows):
        start = 0
        for i, n in enumerate(lengths):
            out.append((row, start, start + n, i == 0, i == len(lengths) - 1))
            start += n
    return out


def _tokens(x, row, a, b):
    return x[row:row + 1, a:b]


def _rel(x, ref):
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    return float(np.max(np.abs(x - ref)) / max(np.max(np.abs(ref)), 1e-30))


def _interpreted(monkeypatch, table, name, **options):
    """The table's ``name`` entry run in interpret mode and served on any backend (the op's entry still does
    every check and the id-to-document step)."""
    impl = table._impls[name]
    run = functools.partial(impl.run, interpret=True, **options)
    monkeypatch.setitem(table._impls, name, dataclasses.replace(impl, run=run, supports=lambda call: None))


def _check_documents(packed, alone, tol, rows=ROWS):
    """``packed(segment_ids)`` -> (out [rows, T, ...], finals [rows, ...] tuple) for the first ``len(rows)``
    input rows; ``alone(row, a, b, first)`` -> the same for one document as a batch-1 row. Every document's
    outputs, and each row's final states, must agree."""
    out, finals = packed(_segment_ids(rows))
    for row, a, b, first, last in _spans(rows):
        out_alone, finals_alone = alone(row, a, b, first)
        assert _rel(out[row, a:b], out_alone[0]) < tol, ("output", row, a, b, _rel(out[row, a:b], out_alone[0]))
        if last:
            for i, (f, f_alone) in enumerate(zip(finals, finals_alone)):
                assert _rel(f[row], f_alone[0]) < tol, ("final state", i, row, _rel(f[row], f_alone[0]))


def test_segment_ids_of_the_layout_reuse_ids():
    """The layout really is non-monotone (guards the rows above against an edit that makes them monotone)."""
    seg = np.asarray(_segment_ids())
    assert seg[0].tolist() == [0] * 4 + [1] * 3 + [0] * 6
    assert all(np.any(np.diff(row) < 0) for row in seg)


# ---------------------------------------------------------------------------------------------------------
# attention


ATTENTION_PATHS = {  # implementation: (head dim, dtype, tolerance, interpret options or None)
    "reference": (16, jnp.float64, 1e-12, None),
    "xla": (16, jnp.float64, 1e-12, None),
    "pallas_tpu": (128, jnp.float32, 2e-5, {}),
    "pallas_triton": (32, jnp.float32, 2e-5, dict(block_q=64, block_k=64, backward_blocks=(32, 32, 32, 32))),
}


@pytest.mark.parametrize("implementation", list(ATTENTION_PATHS))
def test_attention_reused_ids_are_new_documents(implementation, monkeypatch):
    d, dtype, tol, options = ATTENTION_PATHS[implementation]
    if options is not None:
        _interpreted(monkeypatch, attention_api.TABLE, implementation, **options)
    with jax.enable_x64(dtype == jnp.float64):
        keys = jax.random.split(jax.random.key(3), 3)
        q, k, v = (jax.random.normal(kk, (2, T, 2, d), jnp.float32).astype(dtype) for kk in keys)
        run = jax.jit(functools.partial(attention, implementation=implementation))
        _check_documents(lambda seg: (run(q, k, v, segment_ids=seg), ()),
                         lambda row, a, b, first: (run(*(_tokens(x, row, a, b) for x in (q, k, v))), ()), tol)


def test_cudnn_packed_layout_of_reused_ids():
    """cuDNN's packed layout is built from the document index the entry derives: row 0's reused id is a third
    segment, not a continuation of the first."""
    document = attention_api.common.document_index(_segment_ids(), 2, T)
    seqlen, offsets, count = cudnn_packed.segment_layout(document, 6)
    assert count.tolist() == [3, 5]
    assert seqlen.tolist() == [[4, 3, 6, -1, -1, -1], [2, 3, 2, 5, 1, -1]]
    assert offsets.tolist()[0][:4] == [0, 4, 7, -1]


# ---------------------------------------------------------------------------------------------------------
# delta rule


def _delta_rule_inputs(dtype, dk, dv):
    rng = np.random.default_rng(5)
    k = rng.normal(size=(2, T, 2, dk))
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    arrays = dict(q=rng.normal(size=(2, T, 2, dk)) / np.sqrt(dk), k=k, v=rng.normal(size=(2, T, 2, dv)),
                  erase_key=rng.uniform(size=(2, T, 2, dk)) * k,
                  log_decay=-np.logaddexp(0.0, -rng.normal(size=(2, T, 2, dk))))
    state = jnp.asarray(rng.normal(size=(2, 2, dk, dv)), jnp.float64 if dtype == jnp.float64 else jnp.float32)
    return {n: jnp.asarray(x, dtype if n != "log_decay" else state.dtype) for n, x in arrays.items()}, state


DELTA_RULE_PATHS = {  # implementation: (dims, dtype, tolerance, interpret options or None, op options)
    "reference": (8, jnp.float64, 1e-12, None, {}),
    "xla": (8, jnp.float64, 1e-12, None, dict(chunk_size=8, leaf_size=2)),
    "pallas_triton": (16, jnp.float32, 2e-4, {}, dict(chunk_size=32, leaf_size=8)),
}


@pytest.mark.parametrize("implementation", _kernels_extended(DELTA_RULE_PATHS))
def test_delta_rule_reused_ids_are_new_documents(implementation, monkeypatch):
    """(The Pallas TPU kernel's reused-id case: tests/pallas_kernels/test_delta_rule_pallas_tpu.py,
    test_float32_segments_odd_length_c64.)"""
    dims, dtype, tol, options, op_options = DELTA_RULE_PATHS[implementation]
    if options is not None:
        _interpreted(monkeypatch, delta_rule_api.TABLE, implementation, **options)
    with jax.enable_x64(dtype == jnp.float64):
        inputs, state = _delta_rule_inputs(dtype, dims, dims)
        run = jax.jit(functools.partial(delta_rule, implementation=implementation, **op_options))

        def packed(seg):
            rows = seg.shape[0]
            out, final = run(**{n: x[:rows] for n, x in inputs.items()}, initial_state=state[:rows],
                             segment_ids=seg)
            return out, (final,)

        def alone(row, a, b, first):
            out, final = run(**{n: _tokens(x, row, a, b) for n, x in inputs.items()},
                             initial_state=state[row:row + 1] if first else None)
            return out, (final,)

        _check_documents(packed, alone, tol, ROWS if implementation == "reference" else ONE_ROW)


# ---------------------------------------------------------------------------------------------------------
# VLA


def _vla_inputs(dtype, dk, dv):
    rng = np.random.default_rng(9)
    q, k = (jax.nn.elu(rng.normal(size=(2, T, 2, dk))) + 1.0 for _ in range(2))
    arrays = dict(q=q, k=k, v=rng.normal(size=(2, T, 2, dv)), penalty_key=rng.normal(size=(2, T, 2, dk)) + 0.5)
    m = rng.normal(size=(2, 2, dk, dk)) / np.sqrt(dk)
    state = (rng.normal(size=(2, 2, dk, dv)), np.eye(dk) * 5.0 + m @ np.swapaxes(m, -1, -2))
    cast = lambda x: jnp.asarray(np.asarray(x), dtype)  # noqa: E731
    return {n: cast(x) for n, x in arrays.items()}, tuple(cast(s) for s in state)


VLA_PATHS = {  # implementation: (dims, dtype, tolerance, interpret options or None)
    "reference": (8, jnp.float64, 1e-12, None),
    "xla": (8, jnp.float64, 1e-12, None),
    "pallas_tpu": (16, jnp.float32, 2e-4, {}),
    "pallas_triton": (16, jnp.float32, 2e-4, {}),
}


@pytest.mark.parametrize("implementation", _kernels_extended(VLA_PATHS))
def test_vla_reused_ids_are_new_documents(implementation, monkeypatch):
    """Outputs and both final states (S, A); the refresh phase restarts with every document too."""
    dims, dtype, tol, options = VLA_PATHS[implementation]
    if options is not None:
        _interpreted(monkeypatch, vla_api.TABLE, implementation, **options)
    with jax.enable_x64(dtype == jnp.float64):
        inputs, state = _vla_inputs(dtype, dims, dims)
        run = jax.jit(functools.partial(vla_api.vla, implementation=implementation, chunk_size=4, refresh_period=5))

        def packed(seg):
            rows = seg.shape[0]
            return run(**{n: x[:rows] for n, x in inputs.items()}, initial_state=tuple(s[:rows] for s in state),
                       segment_ids=seg)

        def alone(row, a, b, first):
            return run(**{n: _tokens(x, row, a, b) for n, x in inputs.items()},
                       initial_state=tuple(s[row:row + 1] for s in state) if first else None)

        _check_documents(packed, alone, tol, ROWS if implementation == "reference" else ONE_ROW)


# ---------------------------------------------------------------------------------------------------------
# interdomain attention and the S4D core


def _interdomain_inputs(dtype, r, dv, m, selective):
    rng = np.random.default_rng(11)
    q = rng.standard_normal((2, T, 2, r))
    q /= np.linalg.norm(q, axis=-1, keepdims=True)
    delta = np.exp(rng.uniform(np.log(1e-2), np.log(0.5), 2))
    a_re = -np.exp(rng.uniform(np.log(0.3), np.log(1.0), (2, m)))
    a_im = np.broadcast_to(np.asarray(ia.s4d_inv_imag(m)), (2, m))
    lm = delta[:, None] * a_re
    if selective:
        lm = rng.uniform(0.5, 2.0, (2, T, 2, 1)) * lm
    c = rng.standard_normal((2, 2, m, m)) / np.sqrt(2 * m)
    cast = lambda x: jnp.asarray(np.asarray(x), dtype)  # noqa: E731
    tokens = dict(q=cast(q), k=cast(rng.standard_normal((2, T, 2, r))), v=cast(rng.standard_normal((2, T, 2, dv))))
    params = dict(log_modulus=cast(lm), phase=cast(delta[:, None] * a_im),
                  input_gain=ia.zoh_input_gain(cast(a_re), cast(a_im), cast(delta)),
                  readout=ia.readout_matrix(cast(c[0]), cast(c[1])))
    state = ia.InterdomainState(cast(rng.standard_normal((2, 2, 2 * m, r))),
                                cast(rng.standard_normal((2, 2, 2 * m, dv))))
    return tokens, params, state, ia.readout_vector(cast(c[0]), cast(c[1]), cast(rng.standard_normal((2, m))))


IA_PATHS = {  # implementation: (R = Dv, modes, dtype, tolerance, interpret options or None, chunk, selective)
    "reference": (4, 3, jnp.float64, 1e-12, None, None, True),
    "xla": (4, 3, jnp.float64, 1e-12, None, 4, True),
    "toeplitz": (4, 3, jnp.float64, 1e-10, None, 8, False),
    "pallas_tpu": (16, 16, jnp.float32, 2e-4, {}, 32, True),
    "pallas_triton": (16, 16, jnp.float32, 2e-4, {}, 16, True),
}


# The kernels of interdomain attention are extended (see _kernels_extended); those of the S4D core stay: their own
# interpret tests are extended, so this is the S4D kernels' one run in make test.
@pytest.mark.parametrize("implementation, op", [
    pytest.param(i, op, marks=pytest.mark.extended) if i.startswith("pallas_") and op == "interdomain" else (i, op)
    for i in IA_PATHS for op in ("interdomain", "s4d")])
def test_interdomain_and_s4d_reused_ids_are_new_documents(op, implementation, monkeypatch):
    """Outputs and the final states (IA: key and value; S4D: its one state)."""
    dims, modes, dtype, tol, options, chunk, selective = IA_PATHS[implementation]
    table = ia.TABLE if op == "interdomain" else ia.S4D_TABLE
    if options is not None:
        _interpreted(monkeypatch, table, implementation, **options)
    with jax.enable_x64(dtype == jnp.float64):
        tokens, params, state, readout_vector = _interdomain_inputs(dtype, dims, dims, modes, selective)

        @functools.partial(jax.jit, static_argnums=(0, 1, 2, 3))
        def run(row, a, b, first, seg):
            rows = None if seg is None else seg.shape[0]
            cut = (lambda x: x[:rows]) if row is None else (lambda x: _tokens(x, row, a, b))
            pick = (lambda s: s[:rows]) if row is None else (lambda s: s[row:row + 1])
            p = dict(params, log_modulus=cut(params["log_modulus"]) if selective else params["log_modulus"])
            if op == "interdomain":
                s0 = ia.InterdomainState(*(pick(s) for s in state)) if first else None
                o, s = ia.interdomain(*(cut(x) for x in tokens.values()), **p, initial_state=s0, segment_ids=seg,
                                      chunk_size=chunk, implementation=implementation)
                return o, tuple(s)
            p["readout"] = readout_vector
            o, s = ia.s4d(cut(tokens["v"]), **p, initial_state=pick(state.value) if first else None,
                          segment_ids=seg, chunk_size=chunk, implementation=implementation)
            return o, (s,)

        _check_documents(lambda seg: run(None, 0, T, True, seg), lambda row, a, b, first: run(row, a, b, first, None),
                         tol, ROWS if implementation == "reference" else ONE_ROW)


# ---------------------------------------------------------------------------------------------------------
# short convolution


SHORT_CONV_PATHS = {  # implementation: (dtype, tolerance, interpret options or None)
    "reference": (jnp.float64, 1e-12, None),
    "xla": (jnp.float64, 1e-12, None),
    "pallas_triton": (jnp.float32, 1e-5, dict(block_t=16, block_c=32, bwd_block_t=8, bwd_block_c=32, bwd_steps=4)),
}


@pytest.mark.parametrize("implementation", list(SHORT_CONV_PATHS))
def test_short_conv_reused_ids_are_new_documents(implementation, monkeypatch):
    """K = 4 reaches across a whole 3-token document: token 7 (id 0, third document of row 0) must not read
    token 3 (id 0, first document); row 1's 1-token last document reads nothing before it. Outputs and dx."""
    dtype, tol, options = SHORT_CONV_PATHS[implementation]
    if options is not None:
        _interpreted(monkeypatch, short_conv_api.TABLE, implementation, **options)
    with jax.enable_x64(dtype == jnp.float64):
        rng = np.random.default_rng(13)
        x = jnp.asarray(rng.normal(size=(2, T, 8)), dtype)
        w = jnp.asarray(rng.normal(size=(4, 8)), dtype)

        @jax.jit
        def run(x_, seg):
            return short_conv_api.causal_conv(x_, w, seg, True, dtype, implementation)

        def with_grad(x_, seg):  # dx of Σ y²: a leak would show in the gradient of the earlier document too
            y, vjp = jax.vjp(lambda x__: run(x__, seg), x_)
            return y, vjp(2 * y)[0]

        _check_documents(lambda seg: (jnp.concatenate(with_grad(x[:seg.shape[0]], seg), -1), ()),
                         lambda row, a, b, first: (jnp.concatenate(with_grad(_tokens(x, row, a, b), None), -1), ()),
                         tol, ROWS if options is None else ONE_ROW)


def test_short_conv_layer_decode_cache_holds_only_the_last_document():
    """The decode cache after a prefill keeps the last K−1 inputs of the last token's DOCUMENT: ids 0,1,0 over
    tokens (…, 5, 6, 7) leave only token 7 (token 5 has the same id but another document)."""
    from flax import nnx

    from mixerlab.mixers.short_conv import ShortConv

    conv = ShortConv(2, kernel_size=4, rngs=nnx.Rngs(0))
    x = jnp.arange(16, dtype=jnp.float32).reshape(1, 8, 2) + 1.0
    seg = jnp.asarray([[0, 0, 0, 0, 0, 0, 1, 0]], jnp.int32)
    cache = np.asarray(conv.cache_from_sequence(x, seg))
    np.testing.assert_array_equal(cache[0], [[0, 0], [0, 0], [15, 16]])
