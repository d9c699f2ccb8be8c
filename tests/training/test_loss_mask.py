"""The loss mask (models/decoder.py ``cross_entropy``): masked positions contribute nothing, the mean is over
the unmasked positions only."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from models.decoder import cross_entropy


def test_masked_positions_do_not_count():
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.normal(size=(2, 6, 5)), jnp.float32)
    targets = jnp.asarray(rng.integers(0, 5, size=(2, 6)), jnp.int32)
    mask = jnp.asarray([[1, 1, 0, 1, 0, 0], [0, 1, 1, 1, 1, 0]], jnp.float32)
    loss, count = cross_entropy(logits, targets, mask)
    nll = -np.take_along_axis(np.asarray(jax.nn.log_softmax(logits, axis=-1)), np.asarray(targets)[..., None], -1)[..., 0]
    assert float(count) == 7.0
    np.testing.assert_allclose(float(loss), nll[np.asarray(mask) == 1].mean(), rtol=1e-6)  # float32 sums of 7 terms
    # anything at a masked position (e.g. a document's last token predicting the next document) is ignored
    scrambled = jnp.where(mask[..., None] == 0, 100.0 * logits, logits)
    np.testing.assert_allclose(float(cross_entropy(scrambled, targets, mask)[0]), float(loss), rtol=1e-6)
