"""Generation and teacher-forced decoding through the model's decode path (``Decoder.decode``: KV cache for
softmax attention, the recurrent state for every other mixer).

``greedy_generate(model, prompts, max_new_tokens, stop_tokens=()) -> list[list[int]]``
``sample(model, prompts, max_new_tokens, *, temperature=1.0, top_k=0, seed=0, stop_tokens=())``
    Return only the new tokens of each prompt. A row stops at its first stop token, which is NOT included in
    its output, or after ``max_new_tokens`` tokens.

    Prompts of different lengths share one batch: they are left-aligned, every row starts at position 0 and
    all rows advance one position per step, so the positions of a step are the same for every row. A row is
    teacher-forced with its own prompt token while the step is inside its prompt, and fed back its own
    prediction after that (the prefill and the generation are one ``lax.while_loop`` that ends once every row
    is done). Rows with shorter prompts start generating earlier; no padding token ever enters a row's state.
    Shapes are bucketed (prompt length and ``max_new_tokens`` rounded up to powers of two, at least 16), so
    batches of similar sizes reuse one compiled loop. The KV cache of softmax layers holds
    ``bucket(max prompt) + bucket(max_new_tokens)`` positions; recurrent layers keep a constant-size state.

``decode_scan(model, tokens_BT, cache, start) -> (logits_BTV, cache)``
    Feeds T tokens per row through ``decode`` (a jitted ``lax.scan``) at positions ``start + t``, carrying
    ``cache``; used for streaming evaluation and for checking decode against the parallel forward.
"""
from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

MIN_BUCKET = 16


def bucket(n: int) -> int:
    """The smallest power of two >= max(n, MIN_BUCKET)."""
    return max(MIN_BUCKET, 1 << max(0, int(n) - 1).bit_length())


# ------------------------------------------------------------------------------------- teacher forcing
@functools.partial(jax.jit, static_argnums=0)
def _decode_scan(graphdef, state, tokens_BT, cache, start_B):
    model = nnx.merge(graphdef, state)

    def body(cache, xs):
        tok_B, t = xs
        logits, cache = model.decode(tok_B[:, None], cache, start_B + t)
        return cache, logits[:, 0]

    t = tokens_BT.shape[1]
    cache, logits_TBV = jax.lax.scan(body, cache, (tokens_BT.T, jnp.arange(t, dtype=jnp.int32)))
    return jnp.swapaxes(logits_TBV, 0, 1), cache


def decode_scan(model, tokens_BT, cache, start=0):
    """Logits [B,T,V] of feeding ``tokens_BT`` through ``model.decode`` one position at a time, starting at
    position ``start`` (an int, or one int per row), and the cache after the last token."""
    tokens_BT = jnp.asarray(tokens_BT, jnp.int32)
    if tokens_BT.ndim != 2:
        raise ValueError(f"decode_scan: tokens must be [batch, time], got shape {tokens_BT.shape}")
    start_B = jnp.broadcast_to(jnp.asarray(start, jnp.int32), (tokens_BT.shape[0],))
    graphdef, state = nnx.split(model)
    return _decode_scan(graphdef, state, tokens_BT, cache, start_B)


# ------------------------------------------------------------------------------------------ generation
def _choose(logits_BV, key, temperature, top_k: int, greedy: bool):
    if greedy:
        return jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
    logits = logits_BV / temperature
    if top_k and top_k < logits.shape[-1]:
        kth = jax.lax.top_k(logits, top_k)[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


@functools.partial(jax.jit, static_argnums=(0, 5, 8, 9))
def _generate(graphdef, state, tokens_BP, lengths_B, budget, n: int, key, stops, top_k: int, greedy: bool,
              temperature):
    """Rows of ``tokens_BP`` (prompt i = tokens_BP[i, :lengths_B[i]]) continued by up to ``budget`` tokens into
    an [B, n] buffer (n = the bucketed budget); ``stops`` are the stop ids, padded with -1. Returns (buffer,
    tokens written per row)."""
    model = nnx.merge(graphdef, state)
    b, p = tokens_BP.shape
    rows = jnp.arange(b)

    def cond(c):
        t, _, _, _, _, done, _ = c
        return jnp.any(~done) & (t < p + n - 1)

    def body(c):
        t, tok, cache, out, n_out, done, key = c
        logits, cache = model.decode(tok[:, None], cache, jnp.full((b,), t, jnp.int32))
        key, sub = jax.random.split(key)
        nxt = _choose(logits[:, 0], sub, temperature, top_k, greedy)
        new = (t + 1 >= lengths_B) & ~done  # this step predicts a token after the row's prompt
        slot = jnp.minimum(n_out, n - 1)
        out = out.at[rows, slot].set(jnp.where(new, nxt, out[rows, slot]))
        n_out = n_out + new.astype(jnp.int32)
        stopped = jnp.any(nxt[:, None] == stops[None, :], axis=1)
        done = done | (new & (stopped | (n_out >= budget)))
        prompt_next = tokens_BP[rows, jnp.minimum(t + 1, p - 1)]
        return t + 1, jnp.where(t + 1 < lengths_B, prompt_next, nxt), cache, out, n_out, done, key

    init = (jnp.int32(0), tokens_BP[:, 0], model.init_cache(b, p + n), jnp.zeros((b, n), jnp.int32),
            jnp.zeros((b,), jnp.int32), jnp.zeros((b,), bool), key)
    _, _, _, out, n_out, _, _ = jax.lax.while_loop(cond, body, init)
    return out, n_out


def _check_prompts(prompts, max_new_tokens) -> None:
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens: must be an integer >= 0, got {max_new_tokens!r}")
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise ValueError(f"prompts: expected a non-empty list of token lists, got {type(prompts).__name__} "
                         f"{prompts!r:.80}")
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise ValueError(f"prompts[{i}] is empty; a prompt needs at least one token (e.g. the tokenizer's "
                             f"eos_id as a start token)")


def _run(model, prompts, max_new_tokens, stop_tokens, *, greedy, temperature=1.0, top_k=0, seed=0):
    _check_prompts(prompts, max_new_tokens)
    if max_new_tokens == 0:
        return [[] for _ in prompts]
    lengths = np.array([len(p) for p in prompts], np.int32)
    p, n = bucket(lengths.max()), bucket(max_new_tokens)
    tokens = np.zeros((len(prompts), p), np.int64)
    for i, row in enumerate(prompts):
        tokens[i, :len(row)] = row
    vocab = model.embed.num_embeddings
    bad = (tokens < 0) | (tokens >= vocab)
    if bad.any():
        i = int(np.argmax(bad.any(axis=1)))
        raise ValueError(f"prompts[{i}] holds token ids outside [0, {vocab}) (the model's vocabulary): "
                         f"{tokens[i][bad[i]][:5].tolist()}")
    tokens = tokens.astype(np.int32)
    stop = sorted({int(s) for s in stop_tokens})
    if any(s < 0 for s in stop):
        raise ValueError(f"stop_tokens: token ids must be >= 0, got {list(stop_tokens)}")
    stops = np.full(max(8, len(stop)), -1, np.int32)  # a fixed width: new stop ids do not recompile
    stops[:len(stop)] = stop
    graphdef, state = nnx.split(model)
    out, n_out = _generate(graphdef, state, jnp.asarray(tokens), jnp.asarray(lengths), jnp.int32(max_new_tokens), n,
                           jax.random.key(seed), jnp.asarray(stops), int(top_k), greedy, jnp.float32(temperature))
    out, n_out = np.asarray(out), np.asarray(n_out)
    results = []
    for row, count in zip(out, n_out):
        new = row[:count].tolist()
        if new and new[-1] in stop:
            new.pop()
        results.append(new)
    return results


def greedy_generate(model, prompts: list[list[int]], max_new_tokens: int,
                    stop_tokens: tuple[int, ...] = ()) -> list[list[int]]:
    """The argmax continuation of every prompt (new tokens only, stop token excluded)."""
    return _run(model, prompts, max_new_tokens, stop_tokens, greedy=True)


def sample(model, prompts: list[list[int]], max_new_tokens: int, *, temperature: float = 1.0, top_k: int = 0,
           seed: int = 0, stop_tokens: Sequence[int] = ()) -> list[list[int]]:
    """Sampled continuations: softmax(logits / temperature), restricted to the ``top_k`` most likely tokens
    when ``top_k`` > 0; reproducible for a given ``seed`` and batch. ``temperature=0`` is greedy."""
    if temperature < 0:
        raise ValueError(f"temperature: must be >= 0 (0 = greedy), got {temperature}")
    if isinstance(top_k, bool) or not isinstance(top_k, (int, np.integer)) or top_k < 0:
        raise ValueError(f"top_k: must be an integer >= 0 (0 = no restriction), got {top_k!r}")
    return _run(model, prompts, max_new_tokens, stop_tokens, greedy=temperature == 0, temperature=temperature or 1.0,
                top_k=top_k, seed=seed)
