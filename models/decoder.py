"""Llama-style pre-norm decoder whose token mixer is chosen per layer from the registry.

x = embed(tokens); per layer: x += mixer(norm(x)); x += ffn(norm(x)); logits = head(norm(x)).
Embeddings are untied unless ``model.tie_embeddings``; parameters are float32. Mixed precision: the residual
stream x (and so every norm, the embedding output and the final norm) stays in ``model.residual_dtype`` (float32 by
default), while each block's branches -- the mixer and the FFN, their matmuls and kernels -- run in ``model.dtype``:
a branch reads its normed input cast to ``model.dtype`` and its output is added to x in the residual dtype. This is
what torch autocast does (its residual adds stay float32). Beside HF Llama under autocast, from the same weights
and batches, this bfloat16 mode loses no more to float32 than autocast does (docs/benchmarks/parity_h200.md).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from mixerlab.mixers import registry
from mixerlab.mixers.base import MixerSpec
from mixerlab.mixers.blocks import normal
from mixerlab.models.layers import MLP, RMSNorm, SwiGLU
from mixerlab.models.sharding import constrain_batch
from mixerlab.pallas_kernels.common import KERNEL_RESIDUALS


class Block(nnx.Module):
    def __init__(self, m, mixer_options, layer_index: int, *, rngs: nnx.Rngs):
        dtype = jnp.dtype(m.dtype)
        self.compute_dtype = dtype
        self.mixer_name = m.layer_mixers[layer_index]
        spec = MixerSpec(d_model=m.d_model, num_heads=m.num_heads, head_dim=m.key_head_dim,
                         value_head_dim=m.value_width, layer_index=layer_index, num_layers=m.num_layers,
                         dtype=dtype, init_std=m.init_std)
        self.mixer_norm = RMSNorm(m.d_model, eps=m.norm_eps)
        self.mixer = registry.build(self.mixer_name, spec, mixer_options.get(self.mixer_name), rngs=rngs)
        self.ffn_norm = RMSNorm(m.d_model, eps=m.norm_eps)
        if m.ffn_kind == "swiglu":
            self.ffn = SwiGLU(m.d_model, m.ffn_dim, init_std=m.init_std, out_init_std=spec.out_init_std,
                              dtype=dtype, rngs=rngs)
        else:
            self.ffn = MLP(m.d_model, m.ffn_dim, activation=m.ffn_activation, init_std=m.init_std,
                           out_init_std=spec.out_init_std, dtype=dtype, rngs=rngs)

    def __call__(self, x, segment_ids, positions, remat: str = "none"):
        mix = lambda mixer, h: mixer(h, segment_ids=segment_ids, positions=positions)
        if remat == "mixer":  # keep only the mixer's input; recompute its internals in the backward pass
            mix = nnx.remat(mix)
        x = x + mix(self.mixer, self._branch_input(self.mixer_norm, x)).astype(x.dtype)
        return self._add_ffn(x)

    def _branch_input(self, norm, x):
        """A branch's input: the normed residual (computed in float32 by RMSNorm) in the compute dtype."""
        return norm(x).astype(self.compute_dtype)

    def _add_ffn(self, x):
        return x + self.ffn(self._branch_input(self.ffn_norm, x)).astype(x.dtype)

    def decode(self, x, cache, positions):
        y, cache = self.mixer.decode(self._branch_input(self.mixer_norm, x), cache, positions)
        return self._add_ffn(x + y.astype(x.dtype)), cache

    def extend(self, x, cache, positions):
        """C tokens per row continuing the cache: the mixer's parallel ``extend`` where it has one, else its
        ``decode`` over the chunk (a scan; the same result, one token at a time)."""
        h = self._branch_input(self.mixer_norm, x)
        if hasattr(self.mixer, "extend"):
            y, cache = self.mixer.extend(h, cache, positions)
        else:
            def step(c, xs):
                h_t, pos_t = xs
                y_t, c = self.mixer.decode(h_t[:, None], c, pos_t)
                return c, y_t[:, 0]

            cache, y = jax.lax.scan(step, cache, (jnp.swapaxes(h, 0, 1), positions.T))
            y = jnp.swapaxes(y, 0, 1)
        return self._add_ffn(x + y.astype(x.dtype)), cache


_kernels = jax.checkpoint_policies.save_only_these_names(KERNEL_RESIDUALS)
# model.remat -> what a block keeps for its backward pass (the rest is recomputed there); "mixer" is handled in Block
REMAT_POLICIES = {
    "block": None,  # only the block's input
    "kernels": _kernels,  # + the mixer kernels' outputs and residuals: no kernel forward runs twice
    "dots": jax.checkpoint_policies.save_from_both_policies(  # + every matmul output: recompute elementwise work
        jax.checkpoint_policies.dots_with_no_batch_dims_saveable, _kernels),
}


class Decoder(nnx.Module):
    """``model``: the model section of a config (``training.config.ModelConfig`` or anything with its fields);
    ``mixer_options``: {mixer name: its options dataclass}; a mixer not in it gets its defaults."""

    def __init__(self, model, vocab_size: int, *, mixer_options=None, rngs: nnx.Rngs):
        m, mixer_options = model, dict(mixer_options or {})
        self.dtype = jnp.dtype(m.dtype)
        self.residual_dtype = jnp.dtype(m.residual_dtype or m.dtype)
        self.tie_embeddings = m.tie_embeddings
        self.remat = m.remat
        self.embed = nnx.Embed(vocab_size, m.d_model, embedding_init=normal(m.init_std), rngs=rngs)
        self.blocks = nnx.List([Block(m, mixer_options, i, rngs=rngs) for i in range(m.num_layers)])
        self.final_norm = RMSNorm(m.d_model, eps=m.norm_eps)
        if not m.tie_embeddings:
            self.lm_head = nnx.Linear(m.d_model, vocab_size, use_bias=False, dtype=self.dtype,
                                      kernel_init=normal(m.init_std), rngs=rngs)

    def _logits(self, x):
        x = self.final_norm(x)
        logits = self.embed.attend(x) if self.tie_embeddings else self.lm_head(x)
        return constrain_batch(logits.astype(jnp.float32))

    def __call__(self, tokens_BT, *, segment_ids=None, positions=None):
        return self._logits(self.hidden(tokens_BT, segment_ids=segment_ids, positions=positions))

    def hidden(self, tokens_BT, *, segment_ids=None, positions=None):
        """The residual stream after the last block (before the final norm): [B, T, d_model]."""
        b, t = tokens_BT.shape
        if segment_ids is None:
            segment_ids = jnp.ones((b, t), jnp.int32)
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        x = constrain_batch(self.embed(tokens_BT).astype(self.residual_dtype))
        run = lambda block, h: block(h, segment_ids, positions, self.remat)
        if self.remat in REMAT_POLICIES:
            run = nnx.remat(run, policy=REMAT_POLICIES[self.remat])
        for block in self.blocks:
            x = constrain_batch(run(block, x))
        return x

    def chunked_loss(self, hidden_BTD, targets_BT, mask_BT, chunk: int):
        """``cross_entropy(self._logits(hidden), ...)`` computed over slices of ``chunk`` tokens, each slice's
        logits recomputed in the backward pass: only [B, chunk, V] logits are alive at a time instead of
        [B, T, V] (for a 32K vocabulary the logits and their loss buffers are the largest activations)."""
        b, t = hidden_BTD.shape[:2]
        if t % chunk:  # train.loss_chunk is validated against data.seq_len; this guards direct callers
            raise ValueError(f"chunked_loss: chunk={chunk} must divide the sequence length {t}")
        n = t // chunk
        slices = lambda x: jnp.swapaxes(x.reshape(b, n, chunk, *x.shape[2:]), 0, 1)  # noqa: E731  [n, B, c, ...]

        @jax.checkpoint
        def piece(h, tgt, m):
            return jnp.sum(token_nll(self._logits(h), tgt) * m)

        def body(total, xs):
            return total + piece(*xs), None

        total, _ = jax.lax.scan(body, jnp.zeros((), jnp.float32),
                                (slices(hidden_BTD), slices(targets_BT), slices(mask_BT.astype(jnp.float32))))
        count = jnp.sum(mask_BT)
        return total / jnp.maximum(count, 1.0), count

    def init_cache(self, batch_size: int, max_length: int):
        return [block.mixer.init_cache(batch_size, max_length) for block in self.blocks]

    def extend(self, tokens_BC, cache, positions_BC):
        """C tokens per row (one document) continuing ``cache`` at ``positions_BC``, each block in parallel where
        its mixer has ``extend``: (the residual stream after the last block [B, C, d_model], the new cache)."""
        x = self.embed(tokens_BC).astype(self.residual_dtype)
        new_cache = []
        for block, c in zip(self.blocks, cache):
            x, c = block.extend(x, c, positions_BC)
            new_cache.append(c)
        return x, new_cache

    def decode(self, tokens_B1, cache, positions_B):
        """One token per row at ``positions_B``; returns float32 logits [B,1,V] and the new cache."""
        x = self.embed(tokens_B1).astype(self.residual_dtype)
        new_cache = []
        for block, c in zip(self.blocks, cache):
            x, c = block.decode(x, c, positions_B)
            new_cache.append(c)
        return self._logits(x), new_cache


@nnx.jit(donate_argnums=2)
def _extend(model, tokens_BC, cache, positions_BC):
    x, cache = model.extend(tokens_BC, cache, positions_BC)
    return model._logits(x[:, -1:])[:, 0], cache


@nnx.jit(donate_argnums=2)
def _extend_all(model, tokens_BC, cache, positions_BC):
    x, cache = model.extend(tokens_BC, cache, positions_BC)
    return model._logits(x), cache


def extend_logits(model: Decoder, tokens_BC, cache, start):
    """Every position's logits [B, C, V] (float32) of a chunk continuing ``cache`` at positions ``start + c``
    (one document per row, ``Decoder.extend``), and the new cache (the one passed in is donated). The chunked
    counterpart of ``eval.generate.decode_scan``: streaming evaluation feeds a long stream through it."""
    tokens_BC = jnp.asarray(tokens_BC, jnp.int32)
    b, c = tokens_BC.shape
    positions = jnp.broadcast_to(jnp.asarray(start, jnp.int32), (b,))[:, None] + jnp.arange(c, dtype=jnp.int32)
    return _extend_all(model, tokens_BC, cache, positions)


def prefill(model: Decoder, tokens_BT, *, chunk: int = 2048, start=0, cache=None, max_length: int = 0):
    """Chunked prefill: the prompt ``tokens_BT`` (one document per row, at positions ``start + t``) fed through
    the model ``chunk`` tokens at a time, each chunk in parallel from the cache the previous one left (mixers
    with ``extend``: the delta-rule family, interdomain, s4d; the others run ``decode`` over the chunk). Only
    the last token's logits are computed, and the cache is donated from chunk to chunk, so the memory is the
    model, the cache and one chunk's activations, whatever the prompt's length. Returns (logits of the last
    prompt token [B, V] float32, the cache to continue with ``decode`` at position ``start + T``).
    ``cache=None`` starts from ``model.init_cache(B, max_length or start + T)`` (a softmax KV cache must hold every
    position that ``decode`` will write later: pass ``max_length``); a cache passed in is donated, so use the
    returned one."""
    tokens_BT = jnp.asarray(tokens_BT, jnp.int32)
    if tokens_BT.ndim != 2 or tokens_BT.shape[1] == 0:
        raise ValueError(f"prefill: tokens must be a non-empty [batch, time] array, got shape {tokens_BT.shape}")
    if chunk < 1:
        raise ValueError(f"prefill: chunk must be >= 1, got {chunk}")
    b, t = tokens_BT.shape
    start_B = jnp.broadcast_to(jnp.asarray(start, jnp.int32), (b,))
    if cache is None:
        cache = model.init_cache(b, max_length or int(jnp.max(start_B)) + t)
    logits = None
    for lo in range(0, t, chunk):
        piece = tokens_BT[:, lo:lo + chunk]
        positions = start_B[:, None] + lo + jnp.arange(piece.shape[1], dtype=jnp.int32)
        logits, cache = _extend(model, piece, cache, positions)
    return logits, cache


def build_model(cfg, vocab_size: int, *, seed: int = 0) -> Decoder:
    """A concrete model of a config's ``model`` and ``mixers`` sections, parameters drawn from ``seed``."""
    return Decoder(cfg.model, vocab_size, mixer_options=cfg.mixers, rngs=nnx.Rngs(seed))


def abstract_model(cfg, vocab_size: int) -> Decoder:
    """The model's structure with ShapeDtypeStruct leaves: no memory, for parameter counts and AOT compiles."""
    return nnx.eval_shape(lambda: build_model(cfg, vocab_size))


def token_nll(logits_BTV, targets_BT):
    """−log softmax(logits)[target] per position: [B, T]."""
    logz = jax.nn.logsumexp(logits_BTV, axis=-1)
    return logz - jnp.take_along_axis(logits_BTV, targets_BT[..., None], axis=-1)[..., 0]


def cross_entropy(logits_BTV, targets_BT, mask_BT):
    """Mean next-token NLL over the positions where mask is 1 (float32); also returns the token count."""
    nll = token_nll(logits_BTV, targets_BT) * mask_BT
    count = jnp.sum(mask_BT)
    return jnp.sum(nll) / jnp.maximum(count, 1.0), count
