"""Generation and teacher-forced decoding through the model's decode path (``Decoder.decode``: KV cache for
softmax attention, the recurrent state for every other mixer).

``greedy_generate(model, prompts, max_new_tokens, stop_tokens=()) -> list[list[int]]``
``sample(model, prompts, max_new_tokens, *, temperature=1.0, top_k=0, top_p=1.0, seed=0, stop_tokens=())``
    Return only the new tokens of each prompt. A row stops at its first stop token, which is NOT included in
    its output, or after ``max_new_tokens`` tokens.

    Prompts of different lengths share one batch: they are left-aligned, every row starts at position 0 and
    all rows advance one position per step, so the positions of a step are the same for every row. A row is
    teacher-forced with its own prompt token while the step is inside its prompt, and fed back its own
    prediction after that (one ``lax.while_loop`` that ends once every row is done). Rows with shorter prompts
    start generating earlier; no padding token ever enters a row's state. Chunked prefill: the leading
    positions that are prompt in every row (the shortest prompt minus one, rounded down to a power of two,
    when that is at least 16) are fed first in parallel chunks of up to ``PREFILL_CHUNK`` tokens through
    ``Decoder.extend`` (the chunked kernels for the recurrent mixers; softmax attention runs its decode step
    over the chunk), and the loop starts after them; ``chunked_prefill=False`` turns that off.
    Shapes are bucketed (prompt length and ``max_new_tokens`` rounded up to powers of two, at least 16), so
    batches of similar sizes reuse one compiled loop. The KV cache of softmax layers holds
    ``bucket(max prompt) + bucket(max_new_tokens)`` positions; recurrent layers keep a constant-size state.

``filter_logits(logits_BV, temperature, top_k, top_p) -> logits_BV``
    The sampling distribution of ``sample`` as logits (-inf outside it): divided by ``temperature``, then the
    ``top_k`` largest kept (0 = all), then the nucleus: the smallest set of most likely tokens whose
    probability reaches ``top_p`` (1.0 = all; the most likely token is always kept; ties at the cut stay).

``decode_scan(model, tokens_BT, cache, start) -> (logits_BTV, cache)``
    Feeds T tokens per row through ``decode`` (a jitted ``lax.scan``) at positions ``start + t``, carrying
    ``cache``; used for streaming evaluation and for checking decode against the parallel forward.

Command line (``main``): ``python -m eval.generate --run DIR --prompt TEXT [--prompts_file F] [--max_new_tokens N
--temperature T --top_k K --top_p P --seed S --step STEP --batch_size B]`` loads the run's config, tokenizer and
checkpoint (``eval.checkpoint.load_run``), samples a continuation of every prompt in batches, prints each prompt
with its continuation, then one line with the new tokens per second (compile time excluded and reported apart).
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mixerlab.training.cli_errors import entry_point

MIN_BUCKET = 16
PREFILL_CHUNK = 2048  # tokens per parallel prefill chunk (a power of two)


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
def filter_logits(logits_BV, temperature, top_k: int = 0, top_p=1.0, *, nucleus: bool | None = None):
    """Logits of the sampling distribution (see the module docstring); ``nucleus`` (static) skips the sort when
    False, by default it is ``top_p < 1``."""
    logits = logits_BV.astype(jnp.float32) / temperature
    if top_k and top_k < logits.shape[-1]:
        kth = jax.lax.top_k(logits, top_k)[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if nucleus is None:
        nucleus = float(top_p) < 1.0
    if nucleus:
        ordered = -jnp.sort(-logits, axis=-1)  # descending
        probs = jax.nn.softmax(ordered, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs  # probability of the more likely tokens
        keep = before < top_p  # the first token always (before = 0 < top_p)
        cut = jnp.min(jnp.where(keep, ordered, jnp.inf), axis=-1, keepdims=True)
        logits = jnp.where(logits < cut, -jnp.inf, logits)
    return logits


def _choose(logits_BV, key, temperature, top_k: int, greedy: bool, top_p=1.0, nucleus: bool = False):
    if greedy:
        return jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
    logits = filter_logits(logits_BV, temperature, top_k, top_p, nucleus=nucleus)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


def prefill_span(shortest_prompt: int) -> int:
    """How many leading prompt tokens every row shares as prompt before its first prediction, rounded down to a
    power of two (so that prompts of similar lengths reuse one compiled loop); 0 below ``MIN_BUCKET``."""
    span = int(shortest_prompt) - 1  # the step at the last prompt token predicts the first new token
    return 1 << (span.bit_length() - 1) if span >= MIN_BUCKET else 0


def _prefill_cache(model, tokens_BS, cache):
    """The cache after ``tokens_BS`` (positions 0 … S − 1), chunk by chunk in parallel (``Decoder.extend``)."""
    b, span = tokens_BS.shape
    c = min(span, PREFILL_CHUNK)  # both powers of two: c divides span
    pieces = jnp.swapaxes(tokens_BS.reshape(b, span // c, c), 0, 1)

    def body(cache, xs):
        piece, i = xs
        positions = jnp.broadcast_to(i * c + jnp.arange(c, dtype=jnp.int32), (b, c))
        return model.extend(piece, cache, positions)[1], None

    cache, _ = jax.lax.scan(body, cache, (pieces, jnp.arange(span // c, dtype=jnp.int32)))
    return cache


@functools.partial(jax.jit, static_argnums=(0, 5, 8, 9, 12, 13))
def _generate(graphdef, state, tokens_BP, lengths_B, budget, n: int, key, stops, top_k: int, greedy: bool,
              temperature, top_p, nucleus: bool, span: int):
    """Rows of ``tokens_BP`` (prompt i = tokens_BP[i, :lengths_B[i]]) continued by up to ``budget`` tokens into
    an [B, n] buffer (n = the bucketed budget); ``stops`` are the stop ids, padded with -1. The first ``span``
    prompt tokens (inside every row's prompt, ``prefill_span``) are prefilled in parallel chunks, the rest of the
    prompts and the generation run one position per step. Returns (buffer, tokens written per row)."""
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
        nxt = _choose(logits[:, 0], sub, temperature, top_k, greedy, top_p, nucleus)
        new = (t + 1 >= lengths_B) & ~done  # this step predicts a token after the row's prompt
        slot = jnp.minimum(n_out, n - 1)
        out = out.at[rows, slot].set(jnp.where(new, nxt, out[rows, slot]))
        n_out = n_out + new.astype(jnp.int32)
        stopped = jnp.any(nxt[:, None] == stops[None, :], axis=1)
        done = done | (new & (stopped | (n_out >= budget)))
        prompt_next = tokens_BP[rows, jnp.minimum(t + 1, p - 1)]
        return t + 1, jnp.where(t + 1 < lengths_B, prompt_next, nxt), cache, out, n_out, done, key

    cache = model.init_cache(b, p + n)
    if span:
        cache = _prefill_cache(model, tokens_BP[:, :span], cache)
    init = (jnp.int32(span), tokens_BP[:, span], cache, jnp.zeros((b, n), jnp.int32),
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


def _prepare(model, prompts, max_new_tokens, stop_tokens, *, greedy, temperature=1.0, top_k=0, top_p=1.0, seed=0,
             chunked_prefill=True):
    """The arguments of ``_generate`` for a batch of prompts (checked), and the stop ids."""
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
    nucleus = not greedy and float(top_p) < 1.0
    args = (graphdef, state, jnp.asarray(tokens), jnp.asarray(lengths), jnp.int32(max_new_tokens), n,
            jax.random.key(seed), jnp.asarray(stops), int(top_k), greedy, jnp.float32(temperature),
            jnp.float32(top_p), nucleus, prefill_span(lengths.min()) if chunked_prefill else 0)
    return args, stop


def _dynamic(args) -> tuple:
    """The traced arguments of ``_generate`` (what a compiled ``_generate`` takes)."""
    static = (0, 5, 8, 9, 12, 13)
    return tuple(a for i, a in enumerate(args) if i not in static)


def _finish(out, n_out, stop) -> list[list[int]]:
    out, n_out = np.asarray(out), np.asarray(n_out)
    results = []
    for row, count in zip(out, n_out):
        new = row[:count].tolist()
        if new and new[-1] in stop:
            new.pop()
        results.append(new)
    return results


def _run(model, prompts, max_new_tokens, stop_tokens, *, greedy, temperature=1.0, top_k=0, top_p=1.0, seed=0,
         chunked_prefill=True):
    _check_prompts(prompts, max_new_tokens)
    if max_new_tokens == 0:
        return [[] for _ in prompts]
    args, stop = _prepare(model, prompts, max_new_tokens, stop_tokens, greedy=greedy, temperature=temperature,
                          top_k=top_k, top_p=top_p, seed=seed, chunked_prefill=chunked_prefill)
    return _finish(*_generate(*args), stop)


def greedy_generate(model, prompts: list[list[int]], max_new_tokens: int,
                    stop_tokens: tuple[int, ...] = (), *, chunked_prefill: bool = True) -> list[list[int]]:
    """The argmax continuation of every prompt (new tokens only, stop token excluded). ``chunked_prefill=False``
    feeds the prompts one position per step from the start (the module docstring says when it matters)."""
    return _run(model, prompts, max_new_tokens, stop_tokens, greedy=True, chunked_prefill=chunked_prefill)


def _check_sampling(temperature, top_k, top_p) -> None:
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float, np.floating)) \
            or not np.isfinite(temperature) or temperature < 0:
        raise ValueError(f"temperature: must be a finite number >= 0 (0 = greedy), got {temperature!r}")
    if isinstance(top_k, bool) or not isinstance(top_k, (int, np.integer)) or top_k < 0:
        raise ValueError(f"top_k: must be an integer >= 0 (0 = no restriction), got {top_k!r}")
    if isinstance(top_p, bool) or not isinstance(top_p, (int, float, np.floating)) or not 0 < top_p <= 1:
        raise ValueError(f"top_p: must be in (0, 1] (1 = no nucleus restriction), got {top_p!r}")


def sample(model, prompts: list[list[int]], max_new_tokens: int, *, temperature: float = 1.0, top_k: int = 0,
           top_p: float = 1.0, seed: int = 0, stop_tokens: Sequence[int] = (),
           chunked_prefill: bool = True) -> list[list[int]]:
    """Sampled continuations from ``filter_logits``: softmax(logits / temperature), restricted to the ``top_k``
    most likely tokens when ``top_k`` > 0 and then to the nucleus of mass ``top_p`` when ``top_p`` < 1;
    reproducible for a given ``seed`` and batch. ``temperature=0`` is greedy."""
    _check_sampling(temperature, top_k, top_p)
    return _run(model, prompts, max_new_tokens, stop_tokens, greedy=temperature == 0, temperature=temperature or 1.0,
                top_k=top_k, top_p=top_p, seed=seed, chunked_prefill=chunked_prefill)


# ------------------------------------------------------------------------------------------ command line
class CliError(Exception):
    """A problem with the command line or its inputs; printed as one line, exit status 2."""


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m mixerlab.eval.generate",
        description="Sample continuations of prompts from a trained run (its config, tokenizer and checkpoint).")
    ap.add_argument("--run", required=True, help="run directory (train.output_dir) or its checkpoints/ directory")
    ap.add_argument("--prompt", action="append", default=[], help="a prompt (repeat the flag for several)")
    ap.add_argument("--prompts_file", help="one prompt per line, or JSONL with a \"prompt\" field per line")
    ap.add_argument("--max_new_tokens", type=int, default=64, help="new tokens per prompt (default 64)")
    ap.add_argument("--temperature", type=float, default=1.0, help="0 = greedy (default 1.0)")
    ap.add_argument("--top_k", type=int, default=0, help="keep the k most likely tokens; 0 = all (default)")
    ap.add_argument("--top_p", type=float, default=1.0, help="nucleus mass in (0, 1]; 1 = all (default)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--step", type=int, default=None, help="checkpoint step (default: the newest)")
    ap.add_argument("--batch_size", type=int, default=32, help="prompts decoded together (default 32)")
    ap.add_argument("--max_prompt_tokens", type=int, default=None,
                    help="longest prompt accepted, in tokens (default: the run's data.seq_len, the context it was "
                         "trained on)")
    ap.add_argument("--no_stop", action="store_true", help="do not stop a row at the tokenizer's end-of-text token")
    return ap


def read_prompts(path: str) -> list[str]:
    """Prompts of a file: JSONL (every non-empty line an object with a "prompt" string) when the name ends in
    .jsonl or the first non-empty line starts with "{", else one prompt per non-empty line."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = [line.rstrip("\n") for line in f]
    except OSError as e:
        raise CliError(f"--prompts_file: cannot read {path!r} ({e.strerror or e})") from None
    except UnicodeDecodeError as e:
        raise CliError(f"--prompts_file: {path!r} is not UTF-8 text ({e})") from None
    filled = [(i, line) for i, line in enumerate(lines, 1) if line.strip()]
    if not filled:
        raise CliError(f"--prompts_file: {path!r} holds no prompt (every line is empty)")
    if not (path.endswith(".jsonl") or filled[0][1].lstrip().startswith("{")):
        return [line for _, line in filled]
    prompts = []
    for i, line in filled:
        try:
            row = json.loads(line)
        except ValueError as e:
            raise CliError(f"--prompts_file: {path!r} line {i} is not JSON ({e}); JSONL needs one object per line "
                           f"with a \"prompt\" field") from None
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
            raise CliError(f"--prompts_file: {path!r} line {i} has no string \"prompt\" field "
                           f"(got {line[:80]!r})")
        prompts.append(row["prompt"])
    return prompts


def _check_args(args, ap) -> list[str]:
    if args.max_new_tokens < 1:
        ap.error(f"--max_new_tokens: must be >= 1, got {args.max_new_tokens}")
    if args.batch_size < 1:
        ap.error(f"--batch_size: must be >= 1, got {args.batch_size}")
    if args.max_prompt_tokens is not None and args.max_prompt_tokens < 1:
        ap.error(f"--max_prompt_tokens: must be >= 1, got {args.max_prompt_tokens}")
    try:
        _check_sampling(args.temperature, args.top_k, args.top_p)
    except ValueError as e:
        ap.error(f"--{e}")
    prompts = list(args.prompt)
    if args.prompts_file:
        prompts += read_prompts(args.prompts_file)
    if not prompts:
        ap.error("give at least one prompt: --prompt TEXT or --prompts_file FILE")
    return prompts


def _generate_batch(model, ids, args, stop, seed):
    """(new tokens per prompt, compile seconds, generation seconds) of one batch."""
    call, stop_ids = _prepare(model, ids, args.max_new_tokens, stop, greedy=args.temperature == 0,
                              temperature=args.temperature or 1.0, top_k=args.top_k, top_p=args.top_p, seed=seed)
    t0 = time.perf_counter()
    compiled = _generate.lower(*call).compile()
    t1 = time.perf_counter()
    out, n_out = jax.block_until_ready(compiled(*_dynamic(call)))
    t2 = time.perf_counter()
    return _finish(out, n_out, stop_ids), t1 - t0, t2 - t1


@entry_point("mixerlab-generate")
def main(argv: Sequence[str] | None = None) -> int:
    ap = _parser()
    args = ap.parse_args(argv)
    prompts = _check_args(args, ap)
    from mixerlab.eval.checkpoint import load_run  # after the flags: --help does not pay for loading the model code

    try:
        run = load_run(args.run, args.step)
    except (FileNotFoundError, ValueError) as e:
        print(f"eval.generate: --run {args.run}: {e}", file=sys.stderr)
        return 2
    tok = run.tokenizer
    limit = args.max_prompt_tokens or run.cfg.data.seq_len
    ids = []
    for i, text in enumerate(prompts):
        row = tok.encode(text) or [tok.eos_id]  # an empty prompt starts from end-of-text, as a new document
        if len(row) > limit:
            print(f"eval.generate: prompt {i + 1} ({text[:40]!r}...) is {len(row)} tokens; this run was trained on "
                  f"sequences of {run.cfg.data.seq_len} tokens (data.seq_len), the most a prompt may have "
                  f"(--max_prompt_tokens {limit}); shorten it or raise --max_prompt_tokens", file=sys.stderr)
            return 2
        ids.append(row)
    stop = () if args.no_stop else (tok.eos_id,)
    print(f"# run {os.path.abspath(args.run)}, step {run.step}, {','.join(sorted(set(run.cfg.layer_mixers)))}; "
          f"{len(prompts)} prompt(s), temperature {args.temperature}, top_k {args.top_k}, top_p {args.top_p}")
    new_tokens, compile_s, gen_s = 0, 0.0, 0.0
    for start in range(0, len(ids), args.batch_size):
        batch = ids[start:start + args.batch_size]
        outs, c_s, g_s = _generate_batch(run.model, batch, args, stop, args.seed + start)
        compile_s, gen_s = compile_s + c_s, gen_s + g_s
        for j, new in enumerate(outs):
            new_tokens += len(new)
            print(f"\n=== [{start + j + 1}/{len(ids)}] {prompts[start + j]}")
            print(prompts[start + j] + tok.decode(new))
    print(f"\n# {new_tokens} new tokens in {gen_s:.3f} s: {new_tokens / max(gen_s, 1e-9):,.1f} tokens/s "
          f"(compile {compile_s:.2f} s, not counted)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
