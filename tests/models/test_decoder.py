"""Decoder-level properties that must hold for EVERY registered mixer: packed documents are isolated,
the model is causal, and token-by-token decoding equals the parallel forward."""
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mixerlab import mixers
from mixerlab.models.decoder import build_model
from mixerlab.training.config import load_config

MIXERS = mixers.registry.names()
CASES = [*MIXERS, "softmax_conv"]  # softmax_conv: the Transformer with mixers.softmax.use_short_conv


@pytest.fixture(autouse=True)
def _full_precision_matmuls():
    """GPUs default to TF32 for float32 matmuls; these are exactness checks, so ask for full float32."""
    with jax.default_matmul_precision("float32"):
        yield


def _model(mixer, **over):
    if mixer == "softmax_conv":
        mixer, over = "softmax", {"mixers.softmax.use_short_conv": "true", **over}
    args = ["model.d_model=64", "model.num_layers=2", "model.num_heads=2", "model.ffn_dim=96",
            f"model.mixer={mixer}", *[f"{k}={v}" for k, v in over.items()]]
    return build_model(load_config("configs/tiny.yaml", args), vocab_size=97, seed=1)


def _jitted(model):
    """``model(tokens, segment_ids=, positions=)`` compiled once (eagerly, every op of a chunked kernel form would
    compile on its own: several times slower on CPU)."""
    from flax import nnx

    f = nnx.jit(lambda m, t, s, p: m(t, segment_ids=s, positions=p))
    return lambda t, segment_ids=None, positions=None: f(model, t, segment_ids, positions)


def _packed(rng, lengths):
    tokens = np.concatenate([rng.integers(0, 97, n) for n in lengths])
    seg = np.concatenate([np.full(n, i + 1) for i, n in enumerate(lengths)])
    pos = np.concatenate([np.arange(n) for n in lengths])
    return (jnp.asarray(tokens[None], jnp.int32), jnp.asarray(seg[None], jnp.int32), jnp.asarray(pos[None], jnp.int32))


def test_every_registered_mixer_implements_the_mixer_protocol():
    from mixerlab.mixers.base import Mixer

    model = build_model(load_config("configs/tiny.yaml", ["model.num_layers=1"]), vocab_size=97, seed=1)
    assert isinstance(model.blocks[0].mixer, Mixer)
    for name in MIXERS:
        cls = mixers.registry.get(name).cls
        missing = [m for m in ("__call__", "init_cache", "decode") if not callable(getattr(cls, m, None))]
        assert not missing, f"mixer {name!r} ({cls.__name__}) lacks {missing}"
        assert list(inspect.signature(cls.__call__).parameters)[:2] == ["self", "x_BTD"], name


@pytest.mark.parametrize("mixer", CASES)
def test_documents_in_one_row_do_not_see_each_other(mixer):
    model = _jitted(_model(mixer))
    rng = np.random.default_rng(0)
    tokens, seg, pos = _packed(rng, [21, 19, 9])
    base = model(tokens, segment_ids=seg, positions=pos)
    changed = tokens.at[0, 5].set((tokens[0, 5] + 1) % 97)  # a token inside document 1
    out = model(changed, segment_ids=seg, positions=pos)
    doc1 = np.asarray(seg[0] == 1)
    np.testing.assert_array_equal(np.asarray(out[0, ~doc1]), np.asarray(base[0, ~doc1]))
    assert not np.allclose(out[0, 5:21], base[0, 5:21])  # the change is visible inside its own document
    # And a packed document equals the same document run alone: at the start of a row of the same length (the
    # compiled program above serves it), followed by another document of other tokens.
    filler, alone_seg, alone_pos = _packed(rng, [19, 30])
    alone = model(filler.at[:, :19].set(tokens[:, 21:40]), segment_ids=alone_seg, positions=alone_pos)
    np.testing.assert_allclose(np.asarray(base[0, 21:40]), np.asarray(alone[0, :19]), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("mixer", CASES)
def test_decode_token_by_token_equals_parallel_forward(mixer):
    from flax import nnx

    model = _model(mixer)
    t = 13
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 97, (2, t)), jnp.int32)
    full = _jitted(model)(tokens)
    cache = model.init_cache(2, t)
    decode = nnx.jit(lambda m, tok, c, pos: m.decode(tok, c, pos))  # one compile serves every position
    steps = []
    for i in range(t):
        logits, cache = decode(model, tokens[:, i:i + 1], cache, jnp.full((2,), i, jnp.int32))
        steps.append(logits[:, 0])
    np.testing.assert_allclose(np.asarray(jnp.stack(steps, 1)), np.asarray(full), rtol=1e-4, atol=1e-4)
    # position 0 starts a new document: the used cache gives the first step's logits again
    again, _ = decode(model, tokens[:, :1], cache, jnp.zeros((2,), jnp.int32))
    np.testing.assert_allclose(np.asarray(again[:, 0]), np.asarray(steps[0]), rtol=1e-5, atol=1e-5)


def test_bfloat16_compute_keeps_float32_params_and_logits():
    model = _model("softmax", **{"model.dtype": "bfloat16"})
    from flax import nnx

    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    out = model(jnp.zeros((1, 8), jnp.int32))
    assert out.dtype == jnp.float32 and bool(jnp.all(jnp.isfinite(out)))


# gdn2 is extended: the residual stream and its dtype belong to the decoder's blocks, whatever the mixer
@pytest.mark.parametrize("mixer", ["softmax", pytest.param("gdn2", marks=pytest.mark.extended)])
def test_bfloat16_compute_keeps_a_float32_residual_stream_closer_to_float32(mixer):
    """model.residual_dtype=float32 (the default): the residual stream between blocks stays float32 while the
    branches compute in bfloat16, and the logits are closer to the float32 model's than with a bfloat16 stream."""
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, 97, (2, 48)), jnp.int32)
    ref = np.asarray(_model(mixer)(tokens))
    errors = {}
    for residual in ("float32", "null"):
        model = _model(mixer, **{"model.dtype": "bfloat16", "model.residual_dtype": residual})
        want = jnp.float32 if residual == "float32" else jnp.bfloat16
        assert model.hidden(tokens).dtype == want, residual
        errors[residual] = float(np.sqrt(np.mean((np.asarray(model(tokens)) - ref) ** 2)))
    assert errors["float32"] < 0.8 * errors["null"], errors  # measured on CPU: 0.65 (softmax), 0.63 (gdn2)


@pytest.mark.parametrize("remat", ["block", "kernels", "mixer", "dots"])
def test_remat_changes_memory_not_math(remat):
    from flax import nnx

    tokens = jnp.asarray(np.random.default_rng(2).integers(0, 97, (2, 16)), jnp.int32)

    def loss_and_grads(model):
        def f(m):
            return jnp.mean(m(tokens) ** 2)
        return nnx.value_and_grad(f)(model)

    base_loss, base_grads = loss_and_grads(_model("softmax"))
    loss, grads = loss_and_grads(_model("softmax", **{"model.remat": remat}))
    np.testing.assert_allclose(float(loss), float(base_loss), rtol=1e-6)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(base_grads)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)


def _grad_jaxpr(mixer, remat, length):
    """The jaxpr (as text) of the gradient of a small model's loss w.r.t. its parameters."""
    from flax import nnx

    tokens = jnp.asarray(np.random.default_rng(2).integers(0, 97, (2, length)), jnp.int32)
    graphdef, state = nnx.split(_model(mixer, **{"model.remat": remat}))

    def f(state):
        return jnp.mean(nnx.merge(graphdef, state)(tokens) ** 2)
    return str(jax.make_jaxpr(jax.grad(f))(state))


def test_dots_remat_recomputes_no_matmul_that_block_remat_recomputes():
    """remat=dots keeps the outputs of the weight matmuls (no batch dimensions): only the attention score
    matmuls (batched over B, H) are recomputed, far fewer than block remat recomputes."""
    def dots_in_grad(remat):
        return _grad_jaxpr("softmax", remat, 16).count("dot_general")

    none, dots, block = dots_in_grad("none"), dots_in_grad("dots"), dots_in_grad("block")
    assert none < dots < block and block - dots > 2 * (dots - none), (none, dots, block)


def test_kernels_remat_never_runs_a_mixer_kernel_forward_twice():
    """remat=kernels (and dots) keep what the delta-rule kernel's custom VJP saves, so its forward (here the XLA
    form's chunk-state scan, one per layer) is not rerun in the backward pass; remat=block reruns it."""
    def scans_in_grad(remat):
        return _grad_jaxpr("gdn2", remat, 80).count(" scan[")

    none, kernels, dots, block = (scans_in_grad(r) for r in ("none", "kernels", "dots", "block"))
    assert none == kernels == dots and block == none + 2, (none, kernels, dots, block)
