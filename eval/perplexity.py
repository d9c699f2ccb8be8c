"""Validation loss, perplexity and bits per byte; length extrapolation; streaming through the decode state.

    python -m mixerlab.eval.perplexity --run runs/base --data data/embedded/val [--context_multipliers 1,2,3.5]
                              [--max_docs N] [--stream_tokens N] [--out_dir DIR]

Documents: a Parquet file, directory or glob with a text column (``data.text_column``; resolved like
``training.data``), or a ``.txt`` file or glob (each file is one document). Every document is tokenized with the
run's tokenizer and ends with EOS, as in training (``training.data``). T = the run's ``data.seq_len``.

* validation: each document is cut into consecutive windows of T inputs (the context restarts at position 0 in
  every window, as for the training rows); every token after the first is predicted exactly once. loss = mean
  NLL (nats/token, EOS included), perplexity = exp(loss), bits per byte = sum NLL / (ln 2 * bytes) where bytes =
  UTF-8 bytes of ``tokenizer.decode`` of the scored target tokens (EOS decodes to nothing, so it adds NLL and no
  bytes).
* length extrapolation at L = round(m * T) for each multiplier m >= 1, on the documents with at least
  max(L) + 1 tokens (their first max(L) + 1 tokens): perplexity over positions [0, L) with the full context, and
  the Muir paper's paired tail differential (its Table 15: NLL_[127K,128K)(T=128K) - NLL_[127K,128K)(T=4K)):
  Delta_tail(L) = mean NLL of the tail positions [L - w, L) with the whole L-token context minus the mean NLL of
  the same tokens scored inside the training-length window [L - T, L); w = T/4 (the paper's 1K of 4K), mean and
  paired standard error over documents. Negative: the longer context helps; positive: it hurts. Delta_tail(1x)
  is 0 up to float rounding. Per-position NLL buckets (full context, and with the context restarting every T
  tokens) feed the plot. A causal model's NLL at position p does not depend on L, so the curves of the
  multipliers coincide on their common positions; they differ in how far they reach.
* streaming: documents concatenated (tokens + EOS each, positions never reset) into one stream of up to
  ``--stream_tokens`` tokens, fed in chunks of ``--chunk`` tokens, each in parallel from the cache the previous
  one left (``models.decoder.extend_logits``). Recurrent mixers carry a constant-size state; softmax
  attention's KV cache is allocated for the whole stream, so its memory grows linearly with the stream length
  (reported as ``cache_bytes``).

Outputs: a table on stdout, ``perplexity.json`` and ``perplexity.png`` in ``--out_dir`` (default
``<run>/eval``).
"""
from __future__ import annotations

import argparse
import functools
import json
import math
import sys
from typing import Iterable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mixerlab.models.decoder import extend_logits
from mixerlab.training.cli_errors import entry_point, naming
from mixerlab.training import storage

LN2 = math.log(2.0)


# ------------------------------------------------------------------------------------------------ data
def iter_texts(path: str, text_column: str = "text") -> Iterator[str]:
    """Documents of ``path``: Parquet rows (file, directory or glob; the ``text_column``) read one row group at a
    time, or whole ``.txt`` files (a file or a glob)."""
    if path.endswith(".txt"):
        files = storage.glob(path, "--data") if storage.has_glob(path) else [path]
        if not files or not all(storage.isfile(f, "--data") for f in files):
            raise FileNotFoundError(f"--data: no .txt file found at {path!r}")
        for f in files:
            yield storage.read_text(f, "--data")
        return
    from mixerlab.training.data import parquet_file, resolve_parquet_files

    for f in resolve_parquet_files(path, "--data", text_column):
        pf = parquet_file(f, "--data")
        for rg in range(pf.num_row_groups):
            for text in pf.read_row_group(rg, columns=[text_column]).column(0).to_pylist():
                yield "" if text is None else str(text)


def tokenize(tokenizer, text: str) -> np.ndarray:
    """The document's tokens followed by EOS (the training convention)."""
    return np.asarray(tokenizer.encode(text) + [tokenizer.eos_id], np.int32)


# --------------------------------------------------------------------------------------------- scoring
@functools.partial(jax.jit, static_argnums=0)
def _token_logprobs(graphdef, state, inputs_BT, targets_BT):
    logits = nnx.merge(graphdef, state)(inputs_BT)
    picked = jnp.take_along_axis(logits, targets_BT[..., None], axis=-1)[..., 0]
    return picked - jax.nn.logsumexp(logits, axis=-1), jnp.argmax(logits, axis=-1) == targets_BT


def token_logprobs(model, inputs_BT, targets_BT) -> tuple[np.ndarray, np.ndarray]:
    """log p(target_t | inputs_<=t) [B,T] from the parallel forward (positions 0..T-1, one document per row),
    and whether each target is the argmax."""
    graphdef, state = nnx.split(model)
    logp, greedy = _token_logprobs(graphdef, state, jnp.asarray(inputs_BT, jnp.int32),
                                   jnp.asarray(targets_BT, jnp.int32))
    return np.asarray(logp), np.asarray(greedy)


def score_windows(model, windows: Sequence[tuple[np.ndarray, np.ndarray]], length: int,
                  batch_size: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """(log-probs, is-argmax) of every (inputs, targets) window, each scored from position 0. Windows are
    right-padded to ``length`` and batched ``batch_size`` rows at a time (padding rows included), so one
    compiled forward serves them all; padding never affects a real position (the model is causal)."""
    out = []
    for lo in range(0, len(windows), batch_size):
        chunk = windows[lo:lo + batch_size]
        inputs = np.zeros((batch_size, length), np.int32)
        targets = np.zeros((batch_size, length), np.int32)
        for i, (x, y) in enumerate(chunk):
            if len(x) != len(y) or not 0 < len(x) <= length:
                raise ValueError(f"window {lo + i}: inputs ({len(x)}) and targets ({len(y)}) must have the same "
                                 f"length in [1, {length}]")
            inputs[i, :len(x)], targets[i, :len(y)] = x, y
        logp, greedy = token_logprobs(model, inputs, targets)
        out.extend((logp[i, :len(x)], greedy[i, :len(x)]) for i, (x, _) in enumerate(chunk))
    return out


def _nll_of_windows(model, windows, length, batch_size) -> list[np.ndarray]:
    return [-lp.astype(np.float64) for lp, _ in score_windows(model, windows, length, batch_size)]


# ------------------------------------------------------------------------------------------ validation
def validation(model, tokenizer, docs: Sequence[np.ndarray], seq_len: int, batch_size: int = 8) -> dict:
    """Loss, perplexity and bits per byte of the documents in windows of ``seq_len`` (module docstring)."""
    docs = [d for d in docs if len(d) >= 2]
    if not docs:
        raise ValueError("validation: no document has 2 or more tokens (text + EOS)")
    windows = [(d[s:e], d[s + 1:e + 1]) for d in docs for s in range(0, len(d) - 1, seq_len)
               for e in [min(s + seq_len, len(d) - 1)]]
    nll = float(sum(w.sum() for w in _nll_of_windows(model, windows, seq_len, batch_size)))
    tokens = sum(len(d) - 1 for d in docs)
    n_bytes = sum(len(tokenizer.decode(d[1:].tolist()).encode("utf-8")) for d in docs)
    loss = nll / tokens
    return {"loss": loss, "perplexity": math.exp(min(loss, 700.0)),
            "bits_per_byte": nll / (LN2 * n_bytes) if n_bytes else float("nan"),
            "tokens": tokens, "bytes": n_bytes, "documents": len(docs), "windows": len(windows)}


# ----------------------------------------------------------------------------------- length extrapolation
def _bucket_means(nll_DT: np.ndarray, width: int) -> tuple[list[int], list[float]]:
    starts = list(range(0, nll_DT.shape[1], width))
    return starts, [float(nll_DT[:, s:s + width].mean()) for s in starts]


def length_extrapolation(model, docs: Sequence[np.ndarray], seq_len: int, multipliers: Sequence[float], *,
                         tail_tokens: int | None = None, bucket_tokens: int | None = None,
                         batch_size: int = 8) -> dict:
    """Perplexity at L = round(m * seq_len) and the paired tail differential (module docstring)."""
    if not multipliers:
        raise ValueError("context_multipliers: give at least one multiplier (e.g. 1,2,3.5)")
    for m in multipliers:
        if not m >= 1.0:
            raise ValueError(f"context_multipliers: {m} is below 1; the tail differential compares against the "
                             f"training-length window (data.seq_len = {seq_len}), so every multiplier must be >= 1")
    tail = tail_tokens or max(1, seq_len // 4)
    width = bucket_tokens or max(1, seq_len // 4)
    if not 0 < tail <= seq_len:
        raise ValueError(f"tail_tokens: {tail} must be in [1, data.seq_len = {seq_len}]")
    lengths = [int(round(m * seq_len)) for m in multipliers]
    longest = max(lengths)
    long_docs = [d[:longest + 1] for d in docs if len(d) >= longest + 1]
    if not long_docs:
        have = max((len(d) for d in docs), default=0)
        raise ValueError(f"length extrapolation: no document has {longest + 1} tokens (multiplier {max(multipliers)} "
                         f"x data.seq_len {seq_len}, plus the last target); the longest has {have} tokens. Use "
                         f"smaller --context_multipliers or longer documents")
    full = np.stack(_nll_of_windows(model, [(d[:-1], d[1:]) for d in long_docs], longest, batch_size))
    # The context restarting every seq_len tokens: the training-length baseline of the plot.
    chunked = np.concatenate([np.stack(_nll_of_windows(
        model, [(d[s:min(s + seq_len, longest)], d[s + 1:min(s + seq_len, longest) + 1]) for d in long_docs],
        seq_len, batch_size)) for s in range(0, longest, seq_len)], axis=1)
    rows = []
    for m, length in zip(multipliers, lengths):
        window = np.stack(_nll_of_windows(
            model, [(d[length - seq_len:length], d[length - seq_len + 1:length + 1]) for d in long_docs],
            seq_len, batch_size))
        tail_full = full[:, length - tail:length].mean(axis=1)
        tail_window = window[:, seq_len - tail:].mean(axis=1)
        diff = tail_full - tail_window
        n = len(diff)
        nll = float(full[:, :length].mean())
        rows.append({"multiplier": float(m), "length": length, "nll": nll, "perplexity": math.exp(min(nll, 700.0)),
                     "tail_nll": float(tail_full.mean()), "tail_nll_train_window": float(tail_window.mean()),
                     "delta_tail": float(diff.mean()),
                     "delta_tail_se": float(diff.std(ddof=1) / math.sqrt(n)) if n > 1 else float("nan")})
    starts, full_curve = _bucket_means(full, width)
    _, chunked_curve = _bucket_means(chunked, width)
    return {"seq_len": seq_len, "tail_tokens": tail, "bucket_tokens": width, "documents": len(long_docs),
            "lengths": rows, "bucket_start": starts, "nll_full_context": full_curve,
            "nll_train_window": chunked_curve}


# -------------------------------------------------------------------------------------------- streaming
def cache_bytes(model, batch_size: int, max_length: int) -> int:
    """Bytes of the decode cache for ``max_length`` positions (no allocation)."""
    shapes = jax.eval_shape(lambda: model.init_cache(batch_size, max_length))
    return int(sum(s.size * s.dtype.itemsize for s in jax.tree.leaves(shapes)))


def streaming_nll(model, tokens: np.ndarray, chunk: int) -> np.ndarray:
    """NLL of tokens[1:] given everything before, computed by feeding the stream in chunks of ``chunk`` tokens,
    each in parallel from the cache the previous one left (``models.decoder.extend_logits``: the chunked kernels
    for the recurrent mixers, the decode step over the chunk for the others); the last chunk is right-padded
    and its padding is never scored."""
    tokens = np.asarray(tokens, np.int32)
    if tokens.ndim != 1 or len(tokens) < 2:
        raise ValueError(f"streaming: need a 1-D stream of >= 2 tokens, got shape {tokens.shape}")
    if chunk < 1:
        raise ValueError(f"chunk: must be >= 1, got {chunk}")
    inputs, targets = tokens[:-1], tokens[1:]
    n_chunks = -(-len(inputs) // chunk)
    padded = np.zeros((2, n_chunks * chunk), np.int32)
    padded[0, :len(inputs)], padded[1, :len(targets)] = inputs, targets
    cache = model.init_cache(1, n_chunks * chunk)
    nll = []
    for c in range(n_chunks):
        piece = padded[:, c * chunk:(c + 1) * chunk]
        logits, cache = extend_logits(model, piece[:1], cache, c * chunk)
        nll.append(np.asarray(_picked_nll(logits[0], jnp.asarray(piece[1]))))
    return np.concatenate(nll)[:len(inputs)].astype(np.float64)


@jax.jit
def _picked_nll(logits_TV, targets_T):
    return jax.nn.logsumexp(logits_TV, axis=-1) - jnp.take_along_axis(logits_TV, targets_T[:, None], axis=-1)[:, 0]


def streaming(model, docs: Iterable[np.ndarray], *, stream_tokens: int, chunk: int, bucket_tokens: int) -> dict:
    """NLL along one stream of concatenated documents (module docstring)."""
    parts, total = [], 0
    for d in docs:
        parts.append(d[:stream_tokens + 1 - total])
        total += len(parts[-1])
        if total >= stream_tokens + 1:
            break
    stream = np.concatenate(parts) if parts else np.zeros(0, np.int32)
    if len(stream) < 2:
        raise ValueError("streaming: the documents hold fewer than 2 tokens")
    nll = streaming_nll(model, stream, chunk)
    starts, curve = _bucket_means(nll[None], bucket_tokens)
    n = len(stream)
    return {"tokens": int(n - 1), "documents": len(parts), "chunk": chunk, "nll": float(nll.mean()),
            "perplexity": math.exp(min(float(nll.mean()), 700.0)), "bucket_tokens": bucket_tokens,
            "bucket_start": starts, "nll_by_position": curve,
            "cache_bytes": cache_bytes(model, 1, -(-(n - 1) // chunk) * chunk),
            "cache_bytes_one_chunk": cache_bytes(model, 1, chunk)}


# ---------------------------------------------------------------------------------------------- report
def format_table(report: dict) -> str:
    lines = []
    v = report.get("validation")
    if v:
        lines.append(f"validation ({v['documents']} documents, {v['tokens']} tokens, {v['bytes']} bytes, windows of "
                     f"{report['seq_len']}): loss {v['loss']:.4f}  perplexity {v['perplexity']:.2f}  "
                     f"bits/byte {v['bits_per_byte']:.4f}")
    e = report.get("length_extrapolation")
    if e:
        lines.append(f"length extrapolation ({e['documents']} documents; tail = last {e['tail_tokens']} positions):")
        lines.append(f"  {'mult':>5} {'length':>7} {'nll':>8} {'ppl':>9} {'tail nll':>9} {'tail@T':>9} "
                     f"{'Δtail':>9} {'± se':>8}")
        for r in e["lengths"]:
            lines.append(f"  {r['multiplier']:>5g} {r['length']:>7d} {r['nll']:>8.4f} {r['perplexity']:>9.2f} "
                         f"{r['tail_nll']:>9.4f} {r['tail_nll_train_window']:>9.4f} {r['delta_tail']:>+9.4f} "
                         f"{r['delta_tail_se']:>8.4f}")
    s = report.get("streaming")
    if s:
        lines.append(f"streaming ({s['tokens']} tokens of {s['documents']} documents, chunks of {s['chunk']}): "
                     f"nll {s['nll']:.4f}  perplexity {s['perplexity']:.2f}  decode cache {s['cache_bytes']:,} bytes "
                     f"(one chunk's worth: {s['cache_bytes_one_chunk']:,})")
    return "\n".join(lines)


def _multipliers(text: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers such as 1,2,3.5, got {text!r}") from None
    if not values:
        raise argparse.ArgumentTypeError("give at least one multiplier")
    if min(values) < 1:
        raise argparse.ArgumentTypeError(f"every multiplier must be >= 1 (1 = the training context), got {text!r}")
    return values


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m mixerlab.eval.perplexity", description=__doc__.split("\n\n")[0])
    p.add_argument("--run", required=True, help="run directory (train.output_dir) or its checkpoints/ directory")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: the newest)")
    p.add_argument("--data", default=None, help="Parquet file/directory/glob or .txt file/glob "
                                                "(default: the run's data.val_path)")
    p.add_argument("--context_multipliers", type=_multipliers, default=[1.0, 2.0, 3.5],
                   help="lengths as multiples of data.seq_len, each >= 1 (default 1,2,3.5)")
    p.add_argument("--max_docs", type=int, default=None,
                   help="at most this many documents per evaluation (the first ones; for length extrapolation "
                        "the first ones long enough). Default: all")
    p.add_argument("--batch_size", type=int, default=8,
                   help="rows per forward; the logits of a batch take batch x length x vocab x 4 bytes, so lower it "
                        "for long contexts or large vocabularies")
    p.add_argument("--tail_tokens", type=int, default=None, help="tail width w of Δtail (default data.seq_len/4)")
    p.add_argument("--bucket_tokens", type=int, default=None, help="position bucket width (default data.seq_len/4)")
    p.add_argument("--stream_tokens", type=int, default=None,
                   help="length of the streamed stream (default 4 x data.seq_len; 0 skips streaming)")
    p.add_argument("--chunk", type=int, default=None, help="streaming chunk length (default data.seq_len)")
    p.add_argument("--out_dir", default=None, help="where perplexity.json/.png go (default <run>/eval)")
    args = p.parse_args(argv)
    for key in ("max_docs", "batch_size", "tail_tokens", "bucket_tokens", "chunk"):
        value = getattr(args, key)
        if value is not None and value < 1:
            p.error(f"--{key}: must be >= 1, got {value}")
    if args.stream_tokens is not None and args.stream_tokens < 0:
        p.error(f"--stream_tokens: must be >= 0, got {args.stream_tokens}")
    return args


def evaluate_run(args: argparse.Namespace) -> dict:
    from mixerlab.eval.checkpoint import load_run, resolve_run_dirs

    with naming(f"--run {args.run}" + (f" --step {args.step}" if args.step is not None else "")):
        run = load_run(args.run, args.step)
    cfg, tok, model = run.cfg, run.tokenizer, run.model
    t = cfg.data.seq_len
    data = args.data or cfg.data.val_path
    if not data:
        raise ValueError("--data: not given and the run's data.val_path is null")
    limit = args.max_docs or sys.maxsize
    need_long = int(round(max(args.context_multipliers) * t)) + 1
    stream_tokens = 4 * t if args.stream_tokens is None else args.stream_tokens
    val_docs, long_docs, stream_docs, stream_total, longest = [], [], [], 0, 0
    for text in iter_texts(data, cfg.data.text_column):
        d = tokenize(tok, text)
        longest = max(longest, len(d))
        if len(val_docs) < limit:
            val_docs.append(d)
        if len(d) >= need_long and len(long_docs) < limit:
            long_docs.append(d)
        if stream_total < stream_tokens + 1:
            stream_docs.append(d)
            stream_total += len(d)
        if len(val_docs) >= limit and len(long_docs) >= limit and stream_total >= stream_tokens + 1:
            break
    if not val_docs:
        raise ValueError(f"--data: {data!r} holds no document")
    if not long_docs:
        raise ValueError(f"--context_multipliers {max(args.context_multipliers):g}: length extrapolation needs "
                         f"documents of at least {need_long} tokens ({max(args.context_multipliers):g} x data.seq_len "
                         f"{t}, plus the last target); the longest in {data!r} has {longest}. Use smaller multipliers "
                         f"or longer documents")
    report = {"run": resolve_run_dirs(args.run)[0], "step": run.step, "data": data, "tokenizer": tok.name,
              "mixers": sorted(set(cfg.layer_mixers)), "seq_len": t}
    report["validation"] = validation(model, tok, val_docs, t, args.batch_size)
    report["length_extrapolation"] = length_extrapolation(
        model, long_docs, t, args.context_multipliers, tail_tokens=args.tail_tokens,
        bucket_tokens=args.bucket_tokens, batch_size=args.batch_size)
    if stream_tokens:
        report["streaming"] = streaming(model, stream_docs, stream_tokens=stream_tokens, chunk=args.chunk or t,
                                        bucket_tokens=args.bucket_tokens or t)
    return report


@entry_point("mixerlab-eval")
def main(argv=None) -> int:
    args = parse_args(argv)
    report = evaluate_run(args)
    out_dir = args.out_dir or storage.join(report["run"], "eval")
    storage.makedirs(out_dir, "--out_dir")
    json_path, png_path = storage.join(out_dir, "perplexity.json"), storage.join(out_dir, "perplexity.png")
    storage.write_text(json_path, json.dumps(report, indent=1), "--out_dir")
    from mixerlab.eval.plots import plot_perplexity_report

    with storage.local_output(png_path, "--out_dir") as local_png:
        plot_perplexity_report(report, local_png, title=f"{','.join(report['mixers'])} — "
                                                        f"{storage.basename(report['run'])} step {report['step']}")
    print(format_table(report))
    print(f"wrote {json_path} and {png_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
