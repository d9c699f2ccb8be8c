"""Seeded numpy generators for the synthetic recall tasks (VLA paper §5.2; layouts in docs/evaluation.md).

Every generator takes a ``np.random.Generator`` and returns ``{"inputs": int32 [N,T], "labels": int32 [N,T]}``:
``labels[i, t]`` is the token the model must predict from ``inputs[i, :t+1]`` (a next-token target placed on the
position that sees its cue), and ``IGNORE`` (-100) wherever there is no loss or accuracy.

* ``mqar_zoology``        the public HazyResearch/zoology ``multiquery_ar`` rules (comparable to published MQAR).
* ``mqar_vla_contiguous`` the VLA paper's layout ``k1 v1 … kn vn SEP k_π(1) … k_π(n)``, optionally with random
                          filler between SEP and the queries (the long-context variant), and optionally with
                          keys from another token range (the out-of-distribution keys of the paper's Table 13).
* ``copy_task``           ``x1 … xL SEP x1 … xL [PAD]`` with the loss on the copied half.

Sampling "without replacement" is vectorised over rows; the samples therefore differ from zoology's own random
stream (it uses the legacy ``np.random`` global state), but follow the same distribution.
"""
from __future__ import annotations

import numpy as np

IGNORE = -100  # label of positions without loss (PyTorch's ignore_index, as zoology)
SEP = 0  # vla_contiguous and copy: separator token
PAD = 1  # copy: padding token after the copied half


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def _check_count(name: str, value: int, low: int = 1) -> None:
    _require(isinstance(value, (int, np.integer)) and not isinstance(value, bool) and value >= low,
             f"{name}: got {value!r}; must be an integer >= {low}")


def distinct_per_row(rng: np.random.Generator, num_rows: int, low: int, high: int, k: int) -> np.ndarray:
    """``k`` distinct integers per row, uniform over [low, high), in uniformly random order."""
    # The argsort of i.i.d. uniforms is a uniform random permutation; its first k entries are an ordered
    # uniform k-subset (argpartition would leak an index-dependent order).
    return (np.argsort(rng.random((num_rows, high - low)), axis=1)[:, :k] + low).astype(np.int64)


def weighted_distinct_per_row(rng: np.random.Generator, num_rows: int, probs: np.ndarray, k: int) -> np.ndarray:
    """``k`` distinct indices of ``probs`` per row, drawn one after another in proportion to ``probs`` among
    those not yet drawn (numpy's ``choice(replace=False, p=...)``), via the Gumbel top-k identity."""
    gumbel = -np.log(-np.log(rng.random((num_rows, probs.size))))
    scores = np.log(probs)[None, :] + gumbel
    return np.argsort(-scores, axis=1)[:, :k]


def zoology_gap_probs(space: int, power_a: float) -> np.ndarray:
    """p(g) ∝ a (g+1)^(a-1) for g in 0..space-1: zoology's power law favouring short key-to-query gaps."""
    p = power_a * np.arange(1, space + 1, dtype=np.float64) ** (power_a - 1.0)
    return p / p.sum()


def mqar_zoology(rng: np.random.Generator, num_examples: int, *, seq_len: int, num_kv_pairs: int,
                 vocab_size: int, power_a: float = 0.01, random_non_queries: bool = True) -> dict:
    """zoology ``multiquery_ar``: context ``k1 v1 … kn vn`` at 0..2n-1, then key i at offset 2·gap_i of the query
    region; the label (value i) sits on that query-key position. Token 0 is filler (randomised if asked)."""
    _check_count("num_examples", num_examples)
    _check_count("num_kv_pairs", num_kv_pairs)
    _check_count("seq_len", seq_len, 2)
    n, T, V = num_kv_pairs, seq_len, vocab_size
    _require(T % 2 == 0, f"seq_len: got {T}; the zoology layout needs an even sequence length")
    _require(isinstance(V, (int, np.integer)) and V > T,
             f"vocab_size: got {V}; the zoology layout needs vocab_size > seq_len ({T})")
    _require(4 * n <= T, f"num_kv_pairs: got {n}; the zoology layout needs seq_len >= 4*num_kv_pairs, i.e. "
                         f"num_kv_pairs in [1, {T // 4}] for seq_len {T}")
    _require(power_a > 0, f"power_a: got {power_a}; must be > 0 (zoology's default is 0.01)")
    context = 2 * n
    keys = distinct_per_row(rng, num_examples, 1, V // 2, n)
    values = distinct_per_row(rng, num_examples, V // 2, V, n)
    space = (T - context) // 2
    gaps = weighted_distinct_per_row(rng, num_examples, zoology_gap_probs(space, power_a), n)

    examples = np.zeros((num_examples, T + 1), np.int64)
    examples[:, 0:context:2] = keys
    examples[:, 1:context:2] = values
    np.put_along_axis(examples, context + 2 * gaps, keys, axis=1)
    labels = np.full((num_examples, T + 1), IGNORE, np.int64)
    np.put_along_axis(labels, context + 2 * gaps + 1, values, axis=1)
    inputs, labels = examples[:, :-1], labels[:, 1:]  # the target moves onto the query-key position
    if random_non_queries:
        filler = inputs == 0
        inputs = np.where(filler, rng.integers(0, V, size=inputs.shape), inputs)
    return {"inputs": inputs.astype(np.int32), "labels": labels.astype(np.int32)}


def vla_filler(rng: np.random.Generator, keys: np.ndarray, length: int, vocab_size: int) -> np.ndarray:
    """``length`` tokens per row, uniform over [1, vocab_size) minus that row's keys (never SEP, never a key
    that is queried, so the filler cannot be mistaken for a query)."""
    num_rows, n = keys.shape
    allowed = np.ones((num_rows, vocab_size), bool)
    allowed[:, SEP] = False
    np.put_along_axis(allowed, keys, False, axis=1)
    # Row-wise sorted list of allowed tokens (stable argsort puts the True entries first, in order).
    allowed_tokens = np.argsort(~allowed, axis=1, kind="stable")[:, : vocab_size - 1 - n]
    picks = rng.integers(0, vocab_size - 1 - n, size=(num_rows, length))
    return np.take_along_axis(allowed_tokens, picks, axis=1)


def check_key_range(key_range, num_kv_pairs: int, vocab_size: int) -> tuple[int, int]:
    """(low, high) of the key tokens: [1, V/2) by default; a custom range must lie in [1, V) (0 is SEP), hold
    ``num_kv_pairs`` distinct keys, and leave ``num_kv_pairs`` value tokens in [V/2, V) outside a row's keys."""
    V, n = vocab_size, num_kv_pairs
    if key_range is None or len(key_range) == 0:
        return 1, V // 2
    _require(len(key_range) == 2 and all(isinstance(x, (int, np.integer)) for x in key_range),
             f"key_range: got {key_range!r}; expected two integers [low, high) (e.g. [64, 127]) or empty")
    low, high = int(key_range[0]), int(key_range[1])
    _require(1 <= low < high <= V, f"key_range: got [{low}, {high}); must satisfy 1 <= low < high <= vocab_size "
                                   f"({V}); token 0 is SEP")
    _require(high - low >= n, f"key_range: [{low}, {high}) holds {high - low} tokens, fewer than num_kv_pairs={n}")
    overlap = max(0, min(high, V) - max(low, V // 2))  # key tokens inside the value range
    free_values = V // 2 - min(n, overlap)  # per row, in the worst case: the values minus the row's keys
    _require(free_values >= n, f"key_range: [{low}, {high}) can leave only {free_values} value tokens in "
                               f"[{V // 2}, {V}) outside a row's keys, fewer than num_kv_pairs={n}")
    return low, high


def values_avoiding(rng: np.random.Generator, keys: np.ndarray, low: int, high: int) -> np.ndarray:
    """``keys.shape[1]`` distinct values per row, uniform over [low, high) minus that row's keys."""
    num_rows, n = keys.shape
    rows, cols = np.nonzero((keys >= low) & (keys < high))
    taken = np.zeros((num_rows, high - low), bool)
    taken[rows, keys[rows, cols] - low] = True
    scores = np.where(taken, 2.0, rng.random((num_rows, high - low)))  # a row's keys sort last (others < 1)
    return (np.argsort(scores, axis=1)[:, :n] + low).astype(np.int64)


def mqar_vla_contiguous(rng: np.random.Generator, num_examples: int, *, num_kv_pairs: int, vocab_size: int = 128,
                        seq_len: int | None = None, key_range=None) -> dict:
    """``k1 v1 … kn vn SEP [filler] k_π(1) … k_π(n)``; keys distinct from [1, V/2), values distinct from
    [V/2, V) (V = 128: keys 1..63, values 64..127), SEP = 0. The label of each query key is its value, on the
    query's own position. ``seq_len`` None means 3n+1 (no filler); a longer ``seq_len`` inserts
    ``seq_len − 3n − 1`` filler tokens between SEP and the queries (the long-context variant).

    ``key_range`` [low, high): draw the keys from there instead (VLA paper, Table 13: models trained on keys
    {0..63} are tested on keys {64..126}, i.e. [64, 127)). Where that range overlaps the value range, each
    row's values avoid that row's keys, so no token is both a key and a value of one row (the paper does not
    say how it handled the overlap; this is our choice)."""
    _check_count("num_examples", num_examples)
    _check_count("num_kv_pairs", num_kv_pairs)
    n, V = num_kv_pairs, vocab_size
    _require(isinstance(V, (int, np.integer)) and V >= 4 and V % 2 == 0,
             f"vocab_size: got {V}; the vla_contiguous layout needs an even vocab_size >= 4")
    max_pairs = V // 2 - 1
    _require(n <= max_pairs, f"num_kv_pairs: got {n}; the vla_contiguous layout draws distinct keys from "
                             f"{{1..{V // 2 - 1}}} (vocab_size {V}), so it must be in [1, {max_pairs}]")
    T = 3 * n + 1 if seq_len is None else seq_len
    _require(isinstance(T, (int, np.integer)) and T >= 3 * n + 1,
             f"seq_len: got {seq_len}; the vla_contiguous layout needs seq_len >= 3*num_kv_pairs+1 = {3 * n + 1} "
             f"(or null for exactly that)")
    low, high = check_key_range(key_range, n, V)
    keys = distinct_per_row(rng, num_examples, low, high, n)
    if high <= V // 2:  # the default split: values never meet keys
        values = distinct_per_row(rng, num_examples, V // 2, V, n)
    else:
        values = values_avoiding(rng, keys, V // 2, V)
    order = np.argsort(rng.random((num_examples, n)), axis=1)  # π: the query order, one per row
    query_start = T - n

    inputs = np.empty((num_examples, T), np.int64)
    inputs[:, 0:2 * n:2] = keys
    inputs[:, 1:2 * n:2] = values
    inputs[:, 2 * n] = SEP
    inputs[:, 2 * n + 1:query_start] = vla_filler(rng, keys, query_start - 2 * n - 1, V)
    inputs[:, query_start:] = np.take_along_axis(keys, order, axis=1)
    labels = np.full((num_examples, T), IGNORE, np.int64)
    labels[:, query_start:] = np.take_along_axis(values, order, axis=1)
    return {"inputs": inputs.astype(np.int32), "labels": labels.astype(np.int32)}


def copy_task(rng: np.random.Generator, num_examples: int, *, seq_len: int = 64, vocab_size: int = 128) -> dict:
    """``x1 … xL SEP x1 … xL`` (+ one PAD when seq_len is even), L = (seq_len − 1) // 2, x uniform over
    [2, vocab_size) (0 = SEP, 1 = PAD). Next-token labels on the copied half: SEP predicts x1, the copy of x_i
    predicts x_{i+1}; the last copied token (which would predict PAD) and the first half carry no loss."""
    _check_count("num_examples", num_examples)
    _check_count("seq_len", seq_len, 3)
    _require(isinstance(vocab_size, (int, np.integer)) and vocab_size >= 3,
             f"vocab_size: got {vocab_size}; the copy task needs vocab_size >= 3 (SEP=0, PAD=1, content >= 2)")
    L = (seq_len - 1) // 2
    content = rng.integers(2, vocab_size, size=(num_examples, L))
    inputs = np.full((num_examples, seq_len), PAD, np.int64)
    inputs[:, :L] = content
    inputs[:, L] = SEP
    inputs[:, L + 1:2 * L + 1] = content
    labels = np.full((num_examples, seq_len), IGNORE, np.int64)
    labels[:, L:2 * L] = content
    return {"inputs": inputs.astype(np.int32), "labels": labels.astype(np.int32)}
