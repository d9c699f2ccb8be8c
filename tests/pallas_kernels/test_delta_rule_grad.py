"""Custom VJP of the chunkwise path vs jax.grad of the float64 reference, for every input (q, k, v,
erase_key, log_decay in both forms, initial_state), with packed segments (docs/math/delta_rule.md, 'Backward pass')."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from delta_rule_cases import (GRAD_NAMES, documents_as_rows, gdn2_inputs, max_rel_err, outputs_and_grads,
                              segment_ids_from_lengths, x64)

F64_GRAD_TOL = 1e-8  # observed ≤ 1e-15


@pytest.fixture(autouse=True)
def _float64():
    with x64():
        yield


def _weights(seed, inputs):
    rng = np.random.default_rng(seed)
    out_w = jnp.asarray(rng.normal(size=inputs["v"].shape))
    state_w = jnp.asarray(rng.normal(size=inputs["initial_state"].shape))
    return out_w, state_w


@pytest.mark.parametrize("decay, lengths, tiling", [
    ("channel", (10, 30, 27), dict(chunk_size=16, leaf_size=4)),
    ("head", (10, 30, 27), dict(chunk_size=16, leaf_size=4)),
    ("channel", (67,), dict(chunk_size=8, leaf_size=8)),
])
def test_custom_vjp_matches_reference_grad(decay, lengths, tiling):
    inputs = gdn2_inputs(20, 2, sum(lengths), 2, 8, 12, decay=decay)
    out_w, state_w = _weights(20, inputs)
    segment_ids = segment_ids_from_lengths(lengths, batch=2)
    *_, expected = outputs_and_grads(inputs, out_w, state_w, segment_ids, implementation="reference")
    *_, got = outputs_and_grads(inputs, out_w, state_w, segment_ids, implementation="xla", **tiling)
    for name in GRAD_NAMES:
        assert got[name].shape == inputs[name].shape and got[name].dtype == inputs[name].dtype, name
        err = max_rel_err(got[name], expected[name])
        assert err <= F64_GRAD_TOL, (name, err)


def test_packed_gradients_equal_separate_documents():
    """Gradients of a packed row (xla) == gradients of each document run on its own (reference, one batch row
    per document), the initial state reaching only the first document."""
    lengths = (37, 60, 5, 26)  # mid-chunk starts, a document across a chunk boundary, one shorter than a leaf
    inputs = gdn2_inputs(21, 1, sum(lengths), 2, 8, 8)
    out_w, _ = _weights(21, inputs)
    state_w = jnp.zeros_like(inputs["initial_state"])  # the packed final state is that of the last document
    *_, packed = outputs_and_grads(inputs, out_w, state_w, segment_ids_from_lengths(lengths),
                                   implementation="xla", chunk_size=64, leaf_size=8)
    rows = documents_as_rows(inputs, lengths)
    row_out_w = documents_as_rows({"v": out_w, "initial_state": state_w}, lengths)["v"]
    *_, separate = outputs_and_grads(rows, row_out_w, jnp.zeros_like(rows["initial_state"]),
                                     implementation="reference")
    assert max_rel_err(packed["initial_state"], separate["initial_state"][:1]) <= F64_GRAD_TOL
    start = 0
    for row, n in enumerate(lengths):
        for name in GRAD_NAMES[:-1]:
            err = max_rel_err(packed[name][0, start:start + n], separate[name][row, :n])
            assert err <= F64_GRAD_TOL, (row, name, err)
        start += n
