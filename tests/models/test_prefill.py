"""Chunked prefill (``models.decoder.prefill``): feeding a prompt chunk by chunk, each chunk in parallel from the
cache the previous one left, gives the parallel forward's last logits and a cache that ``decode`` continues
exactly — for the mixers with a parallel ``extend`` and for those the decoder runs token by token."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mixerlab import mixers
from mixerlab.models.decoder import build_model, prefill
from mixerlab.training.config import load_config

WITH_EXTEND = [n for n in mixers.registry.names() if hasattr(mixers.registry.get(n).cls, "extend")]


@pytest.fixture(autouse=True)
def _full_precision_matmuls():
    with jax.default_matmul_precision("float32"):
        yield


def _model(mixer):
    args = ["model.d_model=64", "model.num_layers=2", "model.num_heads=2", "model.ffn_dim=96", f"model.mixer={mixer}"]
    return build_model(load_config("configs/tiny.yaml", args), vocab_size=97, seed=1)


def test_the_recurrent_mixers_have_a_parallel_extend():
    assert {"gdn2", "muir", "gated_deltanet", "kda", "deltanet", "interdomain", "s4d"} <= set(WITH_EXTEND)


@pytest.mark.parametrize("mixer", ["gdn2", pytest.param("muir", marks=pytest.mark.extended), "interdomain", "s4d",
                                   "softmax", "vla"])
def test_chunked_prefill_equals_the_parallel_forward_and_decode_continues_it(mixer):
    """13 tokens in chunks of 5, 5 and 3 (a ragged last chunk), at B = 2: the last logits equal the parallel
    forward's at position 12; one decode step from the returned cache equals the forward's logits at 13."""
    model = _model(mixer)
    t = 13
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 97, (2, t + 1)), jnp.int32)
    full = nnx.jit(lambda m, x: m(x))(model, tokens)
    last, cache = prefill(model, tokens[:, :t], chunk=5, max_length=t + 1)
    np.testing.assert_allclose(np.asarray(last), np.asarray(full[:, t - 1]), rtol=1e-4, atol=1e-4)
    nxt, _ = nnx.jit(lambda m, x, c, p: m.decode(x, c, p))(model, tokens[:, t:], cache, jnp.full((2,), t, jnp.int32))
    np.testing.assert_allclose(np.asarray(nxt[:, 0]), np.asarray(full[:, t]), rtol=1e-4, atol=1e-4)


def test_prefill_from_a_cache_at_a_start_position_and_a_reset_at_position_zero():
    """Two calls (tokens 0–7, then 8–12 from start 8) equal one; a call at start 0 with a used cache ignores it."""
    model = _model("interdomain")
    tokens = jnp.asarray(np.random.default_rng(2).integers(0, 97, (1, 13)), jnp.int32)
    once, cache_once = prefill(model, tokens, chunk=4)
    _, cache = prefill(model, tokens[:, :8], chunk=4, max_length=13)
    twice, cache_twice = prefill(model, tokens[:, 8:], chunk=4, start=8, cache=cache)
    np.testing.assert_allclose(np.asarray(twice), np.asarray(once), rtol=1e-5, atol=1e-5)
    for a, b in zip(jax.tree.leaves(cache_twice), jax.tree.leaves(cache_once)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
    again, _ = prefill(model, tokens, chunk=4, cache=cache_twice)  # start 0: the old state must not leak in
    np.testing.assert_allclose(np.asarray(again), np.asarray(once), rtol=1e-5, atol=1e-5)


def test_bad_arguments_are_refused():
    model = _model("gdn2")
    with pytest.raises(ValueError, match=r"prefill: tokens must be a non-empty \[batch, time\] array"):
        prefill(model, jnp.zeros((3,), jnp.int32))
    with pytest.raises(ValueError, match="prefill: chunk must be >= 1, got 0"):
        prefill(model, jnp.zeros((1, 4), jnp.int32), chunk=0)
