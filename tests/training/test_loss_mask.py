"""The loss mask end to end: training/data.py builds it from a packed row (1 only where input and target
belong to the same, non-padding document), and models/decoder.py ``cross_entropy`` averages over it
(masked positions contribute nothing)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from mixerlab.models.decoder import cross_entropy
from mixerlab.training.data import _to_example


def test_masked_positions_do_not_count():
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.normal(size=(2, 6, 5)), jnp.float32)
    targets = jnp.asarray(rng.integers(0, 5, size=(2, 6)), jnp.int32)
    mask = jnp.asarray([[1, 1, 0, 1, 0, 0], [0, 1, 1, 1, 1, 0]], jnp.float32)
    loss, count = cross_entropy(logits, targets, mask)
    log_p = np.asarray(jax.nn.log_softmax(logits, axis=-1))
    nll = -np.take_along_axis(log_p, np.asarray(targets)[..., None], -1)[..., 0]
    assert float(count) == 7.0
    np.testing.assert_allclose(float(loss), nll[np.asarray(mask) == 1].mean(), rtol=1e-6)  # float32 sums of 7 terms
    # anything at a masked position (e.g. a document's last token predicting the next document) is ignored
    scrambled = jnp.where(mask[..., None] == 0, 100.0 * logits, logits)
    np.testing.assert_allclose(float(cross_entropy(scrambled, targets, mask)[0]), float(loss), rtol=1e-6)


def test_packed_row_to_example_masks_document_ends_and_padding():
    """A packed row of T+1 = 9 tokens: document 1 (3 tokens), document 2 (3 tokens), then padding
    (segment 0, as the packer leaves the tail of the last row)."""
    row = {"tokens": np.arange(10, 19), "tokens_segment_ids": np.array([1, 1, 1, 2, 2, 2, 0, 0, 0]),
           "tokens_positions": np.array([0, 1, 2, 0, 1, 2, 0, 0, 0])}
    ex = _to_example(row)
    np.testing.assert_array_equal(ex["inputs"], np.arange(10, 18))
    np.testing.assert_array_equal(ex["targets"], np.arange(11, 19))
    np.testing.assert_array_equal(ex["segment_ids"], [1, 1, 1, 2, 2, 2, 0, 0])
    np.testing.assert_array_equal(ex["positions"], [0, 1, 2, 0, 1, 2, 0, 0])
    # no loss where the target is the next document's token (2, 5) or on padding (6, 7)
    np.testing.assert_array_equal(ex["loss_mask"], [1, 1, 0, 1, 1, 0, 0, 0])
