"""Chunkwise "xla" forward == float64 reference (docs/math/delta_rule.md: chunkwise
form, affine chunk map, block inverse, padding) and packed segments: outputs and final states, ≤ 1e-10
relative to max |reference|."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.scipy.linalg import solve_triangular

from delta_rule_cases import (documents_as_rows, gdn2_inputs, jit_delta_rule, max_rel_err, segment_ids_from_lengths,
                              x64)
from mixerlab.pallas_kernels import common
from mixerlab.pallas_kernels.delta_rule import xla

F64_TOL = 1e-10  # observed ≤ 1e-15


@pytest.fixture(autouse=True)
def _float64():
    with x64():
        yield


def _both(inputs, **kw):
    ref = jit_delta_rule(**inputs, implementation="reference", **{k: v for k, v in kw.items()
                                                                  if k == "segment_ids"})
    got = jit_delta_rule(**inputs, implementation="xla", **kw)
    return ref, got


def _assert_close(ref, got, tol=F64_TOL):
    (ref_out, ref_state), (out, state) = ref, got
    assert out.dtype == ref_out.dtype and state.dtype == jnp.float64
    assert max_rel_err(out, ref_out) <= tol, max_rel_err(out, ref_out)
    assert max_rel_err(state, ref_state) <= tol, max_rel_err(state, ref_state)


@pytest.mark.parametrize("chunk_size, leaf_size", [(1, 1), (8, 4), (64, 16), (256, 8)] + [  # make test-all: more pairs
    pytest.param(c, n, marks=pytest.mark.extended) for c, n in ((8, 8), (64, 4), (256, 16))])
def test_chunk_and_leaf_sizes(chunk_size, leaf_size):
    inputs = gdn2_inputs(0, 2, 300, 2, 16, 24)  # T = 300: not a multiple of 8, 64 or 256
    _assert_close(*_both(inputs, chunk_size=chunk_size, leaf_size=leaf_size))


@pytest.mark.parametrize("decay, erase", [("head", True), ("channel", False), (None, True)])
def test_decay_forms_and_no_erase(decay, erase):
    inputs = gdn2_inputs(1, 1, 517, 2, 32, 32, decay=decay, erase=erase)
    _assert_close(*_both(inputs, chunk_size=64, leaf_size=8))


def test_no_initial_state_default_tiling():
    inputs = gdn2_inputs(2, 2, 130, 3, 16, 8, initial_state=False)
    _assert_close(*_both(inputs))


def test_padding_invariance():
    """Zero tokens with λ = 0 change nothing (docs/math/delta_rule.md, 'Chunkwise form')."""
    inputs = gdn2_inputs(3, 1, 90, 2, 16, 16)
    padded = {name: x if name == "initial_state" else jnp.pad(x, [(0, 0), (0, 38)] + [(0, 0)] * (x.ndim - 2))
              for name, x in inputs.items()}
    out, state = jit_delta_rule(**inputs, chunk_size=64, leaf_size=8)
    out_pad, state_pad = jit_delta_rule(**padded, chunk_size=64, leaf_size=8)
    assert max_rel_err(out_pad[:, :90], out) <= F64_TOL
    assert max_rel_err(state_pad, state) <= F64_TOL


# ---------------------------------------------------------------------------------------------------------
# packed documents

PACKED_LENGTHS = (37, 90, 5, 68)  # starts mid-chunk, spans chunk boundaries, a document shorter than a leaf


def _run_separately(inputs, lengths):
    """Each document on its own (one batch row each, reference); the initial state only for the first one.
    Returns (packed-layout outputs of row 0, final state of the last document)."""
    out, state = jit_delta_rule(**documents_as_rows(inputs, lengths), implementation="reference")
    return jnp.concatenate([out[row, :n] for row, n in enumerate(lengths)])[None], state[-1:]


@pytest.mark.parametrize("chunk_size, leaf_size", [(64, 8), (16, 4)])
def test_packed_equals_separate_documents(chunk_size, leaf_size):
    inputs = gdn2_inputs(4, 1, sum(PACKED_LENGTHS), 2, 16, 24)
    segment_ids = segment_ids_from_lengths(PACKED_LENGTHS)
    out, state = jit_delta_rule(**inputs, segment_ids=segment_ids, chunk_size=chunk_size, leaf_size=leaf_size)
    out_sep, state_sep = _run_separately(inputs, PACKED_LENGTHS)
    assert max_rel_err(out, out_sep) <= F64_TOL
    assert max_rel_err(state, state_sep) <= F64_TOL


def test_reused_segment_id_is_a_new_document():
    """t is a boundary iff seg[t] != seg[t−1]: ids [0…, 1…, 0…] are three documents."""
    lengths = (20, 30, 25)
    inputs = gdn2_inputs(5, 1, sum(lengths), 2, 8, 8, decay="head")
    ids = jnp.asarray(np.concatenate([np.zeros(20), np.ones(30), np.zeros(25)]).astype(np.int32))[None]
    ref, got = _both(inputs, segment_ids=ids, chunk_size=16, leaf_size=4)
    _assert_close(ref, got)
    separate = _run_separately(inputs, lengths)
    _assert_close(separate, got)


def test_random_segments_against_reference():
    inputs = gdn2_inputs(6, 2, 300, 2, 16, 16)
    rng = np.random.default_rng(6)
    ids = jnp.asarray(np.cumsum(rng.uniform(size=(2, 300)) < 0.03, axis=1).astype(np.int32))
    _assert_close(*_both(inputs, segment_ids=ids, chunk_size=64, leaf_size=8))


# ---------------------------------------------------------------------------------------------------------
# pieces: recursive inverse, affine chunk map


@pytest.mark.parametrize("chunk, leaf", [(32, 1), (64, 2), (64, 4), (64, 8), (64, 16), (64, 64), (48, 6)])
def test_recursive_inverse(chunk, leaf):
    """Neumann-product leaves + 2×2 merges == inv(I + A) == triangular solve
    (docs/math/delta_rule.md, 'Recursive block inverse')."""
    rng = np.random.default_rng(chunk + leaf)
    a = jnp.asarray(np.tril(rng.normal(size=(3, chunk, chunk)) / np.sqrt(chunk), -1))
    leaf_blocks = xla.diagonal_blocks(a, leaf)
    cross = [xla.diagonal_blocks(a, 2 * h)[..., h:, :h] for h in xla.tree_half_sizes(chunk, leaf)]
    inverse = xla.recursive_inverse(leaf_blocks, cross)
    t = jnp.eye(chunk) + a
    assert float(jnp.max(jnp.abs(inverse - jnp.linalg.inv(t)))) <= 1e-12
    rhs = jnp.asarray(rng.normal(size=(3, chunk, 5)))
    solved = solve_triangular(t, rhs, lower=True, unit_diagonal=True)
    assert float(jnp.max(jnp.abs(inverse @ rhs - solved))) <= 1e-12


@pytest.mark.parametrize("lengths", [(64,), (20, 44)])
def test_affine_chunk_map(lengths):
    """F = Diag(π_C) − (K⊙E)ᵀY == Π_{i=C..1} (I − k_iᵀ k̂_i) Diag(α_i) (docs/math); a boundary inside
    the chunk makes the product 0 (the reset)."""
    chunk, dk = 64, 8
    inputs = gdn2_inputs(7, 1, chunk, 1, dk, 4)
    q, k, erase, v, lam = (xla.to_chunks(inputs[n], chunk) for n in ("q", "k", "erase_key", "v", "log_decay"))
    document = common.document_index(jnp.asarray(segment_ids_from_lengths(lengths)), 1, chunk)
    docs, carry = (x[:, None] for x in common.chunk_documents(document, chunk))
    transition = jax.jit(lambda *a: xla.chunk_tensors(*a, leaf_size=8).transition)(q, k, erase, v, lam, docs, carry)
    k, erase, lam = (np.asarray(x[0, 0, 0]) for x in (k, erase, lam))
    product = np.eye(dk)
    for i in range(chunk):
        if len(lengths) > 1 and i == lengths[0]:
            product = np.zeros((dk, dk))
        product = (np.eye(dk) - np.outer(k[i], erase[i])) @ np.diag(np.exp(lam[i])) @ product
    assert float(np.max(np.abs(np.asarray(transition[0, 0, 0]) - product))) <= 1e-13
