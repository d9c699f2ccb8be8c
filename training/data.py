"""Parquet -> tokens -> packed batches, as a grain pipeline.

One module (about 600 lines) on purpose: its sections (files, source, state, public) are the private stages of one
pipeline that only ``train_iterator`` and ``eval_batches`` assemble; apart, each would be a module of private
names with a single caller.

Pipeline of ``train_iterator`` (one per process)::

    per row slot r of the process (one slot per row of the global batch):
      _ParquetDocs        grain.MapDataset: the slot's documents, shuffled per epoch, repeated forever
        .map(tokenize)    text -> tokens + [eos]          (in grain's prefetch threads, not up front)
        .to_iter_dataset()
      ConcatThenSplitIterDataset(length T+1)           grain's packer: segment ids 1..n, positions per segment
        .map(_to_example)  row[:-1] / row[1:] -> inputs, targets, segment_ids, positions, loss_mask
    InterleaveIterDataset(slots)                        round robin: one row from each slot, in slot order
      [.mp_prefetch(W)]   W worker processes (data.num_workers, cut to a divisor of b): worker w runs slots
                          w, w+W, ...; rows are taken from the workers in turn, so the slot order is kept
      .batch(b)
    _JsonStateIterDataset  get_state() is plain JSON; set_state() accepts it back

Why row slots: row r of every global batch of B rows comes from slot r, which owns the contiguous documents
[N*r/B, N*(r+1)/B) (sorted file order) and is shuffled by (seed, r) alone. Process p of P builds the slots
[B*p/P, B*(p+1)/P), so the global batch is the same on 1 host or 64 as long as B is unchanged.

Documents are addressed as (file, row group, row) from the Parquet footers, so nothing is read up front but
metadata. Shuffling is per epoch and seeded by (seed, slot, epoch): a slot's row-group blocks are permuted,
and documents are permuted within windows of consecutive blocks, so a reader keeps only a window of row
groups in memory (one read per row group per epoch) instead of jumping across a whole corpus. The window is
``SHUFFLE_WINDOW_BLOCKS * 8 // B`` blocks (at least 1): a process holds about (B/P) * (window + 2) row groups.
The corpus in data/embedded is small enough that a window covers a whole slot (a full shuffle).

Each batch is a dict of numpy arrays, local batch b = global_batch_size // process_count:
  inputs, targets, segment_ids, positions: int32 [b, T]; loss_mask: float32 [b, T]
``segment_ids`` are 1..n for the document pieces of a row (0 = padding); ``positions`` restart at 0 in every
segment (a document continued from the previous row starts again at 0); ``loss_mask`` is 1 where the target
is the next token of the same document piece.
"""
from __future__ import annotations

import bisect
import collections
import copy
import json
import os
import sys
import threading
import warnings
from typing import Sequence

import grain
import numpy as np
import pyarrow as pa
import pyarrow.compute  # makes pa.compute available
import pyarrow.parquet as pq
from grain.experimental import ConcatThenSplitIterDataset, InterleaveIterDataset

from mixerlab.training import batch_trace, storage
from mixerlab.training.tokenizer import _REPO_ROOT, Tokenizer, resolve_path

BATCH_KEYS = ("inputs", "targets", "segment_ids", "positions", "loss_mask")
SHUFFLE_WINDOW_BLOCKS = 16  # row-group blocks whose documents are shuffled together
READ_THREADS = 4  # grain prefetch threads per process (tokenisation, Parquet reads)
PREFETCH_DOCS = 64
_STATE_VERSION = 1
SAMPLE_ROW_GROUPS = 32  # row groups read by the start-up check of the text (spread over the files)
EMPTY_WARN_SHARE = 0.1  # warn when more than this share of the sampled documents is empty


# ----------------------------------------------------------------------------------------------- files
def resolve_parquet_files(path: str, key: str, text_column: str = "text") -> list[str]:
    """The Parquet files named by ``path`` (a directory: every ``*.parquet`` inside, sorted; a file; or a
    glob), each checked to have ``text_column``. ``path`` may be a local path or a gs:// / s3:// URL (the
    files are then URLs too). Errors name the config ``key``."""
    if not path:
        raise ValueError(f"{key}: no path given (got {path!r})")
    if storage.is_url(path):
        files = _remote_parquet_files(path, key)
    elif storage.has_glob(path):
        files = storage.glob(path)
        if not files and not os.path.isabs(path):
            files = storage.glob(str(_REPO_ROOT / path))
        files = [f for f in files if os.path.isfile(f)]
        if not files:
            raise FileNotFoundError(f"{key}: no .parquet file matched the glob {path!r}")
    else:
        resolved = resolve_path(path, key)
        if os.path.isdir(resolved):
            files = sorted(os.path.join(resolved, f) for f in os.listdir(resolved)
                           if f.endswith(".parquet") and os.path.isfile(os.path.join(resolved, f)))
            if not files:
                raise FileNotFoundError(f"{key}: no .parquet file matched in the directory {path!r}")
        else:
            files = [resolved]
    for f in files:
        try:
            schema = parquet_file(f, key).schema_arrow
        except storage.StorageError:
            raise
        except Exception as e:  # not Parquet, truncated, ...
            if not _starts_like_parquet(f):
                raise ValueError(_not_parquet_message(f, key, text_column)) from None
            raise ValueError(f"{key}: cannot read the Parquet schema of {f!r}: {e}") from e
        if text_column not in schema.names:
            raise ValueError(f"{key}: {f!r} has no column {text_column!r} (data.text_column); "
                             f"its columns are {schema.names}")
        kind = schema.field(text_column).type
        if not _is_text_type(kind):
            hint = (" (if it holds UTF-8 text, write it as a string column)" if pa.types.is_binary(kind)
                    or pa.types.is_large_binary(kind) else "")
            raise ValueError(f"{key}: column {text_column!r} (data.text_column) of {f!r} has type {kind}, not "
                             f"string{hint}; name a text column")
    return files


def _starts_like_parquet(path: str) -> bool:
    """True unless a local file's first bytes are not Parquet's magic ``PAR1`` (remote files: not checked)."""
    if storage.is_url(path):
        return True
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"PAR1"
    except OSError:
        return True


def _not_parquet_message(path: str, key: str, text_column: str) -> str:
    """JSONL or plain text given where the trainer reads Parquet: which formats are read and how to convert."""
    return (f"{key}: {path!r} is not a Parquet file. Training reads Parquet with a {text_column!r} string column "
            f"(data.text_column): one .parquet file, a directory of them or a glob; or token shards with "
            f"data.format=pretokenized. Convert a JSONL file (one {{\"{text_column}\": ...}} object per line; "
            f"plain text: one such line per document) with `mixerlab-prepare-data --source FILE.jsonl --out DIR` "
            f"and point {key} at DIR/{'train' if key == 'data.train_path' else 'val'}")


def _remote_parquet_files(url: str, key: str) -> list[str]:
    """The files of a gs:// / s3:// glob, "directory" (prefix) or object; StorageError naming key and URL."""
    if storage.has_glob(url):
        files = [f for f in storage.glob(url, key) if storage.isfile(f, key)]
        if not files:
            raise storage.StorageError(f"{key}: no .parquet file matched the glob {url}")
        return files
    if storage.isdir(url, key):
        files = [storage.join(url, n) for n in sorted(storage.listdir(url, key)) if n.endswith(".parquet")]
        if not files:
            raise storage.StorageError(f"{key}: no .parquet file matched in the directory {url}")
        return files
    if not storage.exists(url, key):
        raise storage.describe(FileNotFoundError(url), url, key)
    return [url]


def parquet_file(path: str, key: str = "") -> pq.ParquetFile:
    """A Parquet file of a local path or URL. Remote files are opened without read-ahead: the footer and then
    each row group asked for are fetched by range requests, not the whole object."""
    if not storage.is_url(path):
        return pq.ParquetFile(path)
    return pq.ParquetFile(storage.open_file(path, "rb", key, cache_type="none"))


def _is_text_type(kind) -> bool:
    return pa.types.is_string(kind) or pa.types.is_large_string(kind) or getattr(pa.types, "is_string_view",
                                                                               lambda _: False)(kind)


def check_text_data(path: str, key: str, text_column: str = "text", *, max_row_groups: int = SAMPLE_ROW_GROUPS,
                    empty_warn_share: float = EMPTY_WARN_SHARE) -> list[str]:
    """Start-up check of the documents of ``path``: reads up to ``max_row_groups`` row groups spread evenly
    over the files (every row group of a small corpus) and raises ValueError (naming the file and column) for
    undecodable text or when no sampled document has any text. Returns warnings: the share of empty
    documents when it is above ``empty_warn_share``."""
    files = resolve_parquet_files(path, key, text_column)
    groups = _RowGroups(files)
    if groups.num_docs == 0:
        raise ValueError(f"{key}: {path!r} holds no rows (column {text_column!r}, data.text_column)")
    picks = sorted(set(np.linspace(0, len(groups.groups) - 1, min(max_row_groups, len(groups.groups)))
                       .round().astype(int).tolist()))
    empty = total = 0
    for gi in picks:
        fi, rg, _ = groups.groups[gi]
        column = parquet_file(files[fi], key).read_row_group(rg, columns=[text_column]).column(0)
        try:
            column.validate(full=True)
        except pa.ArrowInvalid as e:
            raise ValueError(f"{key}: column {text_column!r} (data.text_column) of {files[fi]!r}, row group "
                             f"{rg}: the text is not valid UTF-8 ({e})") from None
        lengths = pa.compute.utf8_length(pa.compute.utf8_trim_whitespace(column)).to_numpy(zero_copy_only=False)
        empty += int(np.sum(~(np.nan_to_num(lengths.astype(float), nan=0.0) > 0)))
        total += len(lengths)
    where = repr(files[0]) if len(files) == 1 else f"{path!r} ({len(files)} files)"
    sampled = ("" if len(picks) == len(groups.groups)
               else f" (a sample of {len(picks)} of {len(groups.groups)} row groups)")
    if empty == total:
        raise ValueError(f"{key}: every document in column {text_column!r} (data.text_column) of {where} is "
                         f"empty or null{sampled}; there is nothing to train on")
    warnings_out = []
    if empty / total > empty_warn_share:
        warnings_out.append(f"{key}: {empty} of {total} documents in column {text_column!r} of {where} are empty "
                            f"or null ({empty / total:.0%}{sampled}); they add only an end-of-text token each")
    return warnings_out


class _RowGroups:
    """(file, row group, rows) of every row group of ``files``, from the Parquet footers."""

    def __init__(self, files: Sequence[str]):
        self.files = list(files)
        self.groups: list[tuple[int, int, int]] = []  # (file index, row group index, num rows)
        for fi, f in enumerate(self.files):
            md = parquet_file(f).metadata
            for rg in range(md.num_row_groups):
                n = md.row_group(rg).num_rows
                if n:
                    self.groups.append((fi, rg, n))
        self.starts = np.cumsum([0] + [g[2] for g in self.groups]).tolist()
        self.num_docs = self.starts[-1]

    def blocks(self, lo: int, hi: int) -> list[tuple[int, int, int]]:
        """Row-group pieces covering documents [lo, hi): (group index, first row, end row)."""
        out = []
        for gi, (_, _, n) in enumerate(self.groups):
            s = self.starts[gi]
            a, b = max(lo, s), min(hi, s + n)
            if a < b:
                out.append((gi, a - s, b - s))
        return out


# ----------------------------------------------------------------------------------------------- source
class _ParquetDocs(grain.MapDataset):
    """The texts of a process's documents; index i of an infinite source is document (i mod n) of epoch
    i // n. Shuffled (see the module docstring) when ``seed`` is not None."""

    def __init__(self, groups: _RowGroups, blocks, text_column: str, *, seed: int | None, infinite: bool,
                 window_blocks: int = SHUFFLE_WINDOW_BLOCKS, tokenizer: Tokenizer | None = None):
        super().__init__()
        self._window = max(1, int(window_blocks))
        self._groups = groups
        self._blocks = list(blocks)
        self._sizes = [b - a for _, a, b in self._blocks]
        self._n = int(sum(self._sizes))
        self._text_column = text_column
        self._seed = seed
        self._infinite = infinite
        # With a tokenizer every element is the document's tokens then EOS (int32): a row group is tokenised
        # once, in one batch call (the tokenizer's native threads, outside the GIL), when it is first read.
        self._tokenizer = tokenizer
        self._spans: dict[int, tuple[int, int]] = {}  # group index -> the rows [lo, hi) of it that blocks use
        for gi, a, b in self._blocks:
            lo, hi = self._spans.get(gi, (a, b))
            self._spans[gi] = (min(lo, a), max(hi, b))
        self._init_caches()

    def _init_caches(self):
        self._lock = threading.Lock()
        self._texts: collections.OrderedDict = collections.OrderedDict()  # group index -> list[str]
        self._loading: dict[int, threading.Lock] = {}  # group index -> lock held while one thread reads it
        self._plans: collections.OrderedDict = collections.OrderedDict()  # epoch -> plan
        self._perms: collections.OrderedDict = collections.OrderedDict()  # (epoch, window) -> permutation

    def __getstate__(self):
        state = self.__dict__.copy()
        for k in ("_lock", "_texts", "_loading", "_plans", "_perms"):
            state.pop(k, None)
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._init_caches()

    @property
    def num_docs(self) -> int:
        return self._n

    def __len__(self) -> int:
        return sys.maxsize if self._infinite else self._n

    def __str__(self) -> str:
        return (f"_ParquetDocs(files={len(self._groups.files)}, docs={self._n}, seed={self._seed}, "
                f"infinite={self._infinite})")

    @staticmethod
    def _cache_put(cache: collections.OrderedDict, key, value, maxsize: int):
        cache[key] = value
        cache.move_to_end(key)
        while len(cache) > maxsize:
            cache.popitem(last=False)

    def _plan(self, epoch: int):
        """Block order and window boundaries of an epoch."""
        with self._lock:
            plan = self._plans.get(epoch)
        if plan is not None:
            return plan
        nb = len(self._blocks)
        if self._seed is None:
            order = np.arange(nb)
        else:
            order = np.random.default_rng([self._seed, epoch, 0]).permutation(nb)
        windows = []  # (start doc, [block ids]) per window
        start = 0
        for w in range(0, nb, self._window):
            ids = order[w:w + self._window].tolist()
            windows.append((start, ids, np.cumsum([0] + [self._sizes[i] for i in ids]).tolist()))
            start += windows[-1][2][-1]
        plan = ([w[0] for w in windows], windows)
        with self._lock:
            self._cache_put(self._plans, epoch, plan, 2)
        return plan

    def _perm(self, epoch: int, window: int, size: int):
        key = (epoch, window)
        with self._lock:
            perm = self._perms.get(key)
        if perm is None:
            perm = np.random.default_rng([self._seed, epoch, 1, window]).permutation(size)
            with self._lock:
                self._cache_put(self._perms, key, perm, 4)
        return perm

    def _locate(self, index: int) -> tuple[int, int]:
        """(group index, row) of the index-th document of the stream."""
        epoch, j = divmod(index, self._n)
        starts, windows = self._plan(epoch)
        w = bisect.bisect_right(starts, j) - 1
        wstart, ids, cum = windows[w]
        k = j - wstart
        if self._seed is not None:
            k = int(self._perm(epoch, w, cum[-1])[k])
        b = bisect.bisect_right(cum, k) - 1
        gi, a, _ = self._blocks[ids[b]]
        return gi, a + (k - cum[b])

    def _group_texts(self, gi: int) -> list:
        """The texts of row group ``gi``, read once even when several prefetch threads ask at the same time."""
        with self._lock:
            texts = self._texts.get(gi)
            if texts is not None:
                self._texts.move_to_end(gi)
                return texts
            loading = self._loading.setdefault(gi, threading.Lock())
        with loading:
            with self._lock:
                texts = self._texts.get(gi)
            if texts is None:
                fi, rg, _ = self._groups.groups[gi]
                table = parquet_file(self._groups.files[fi]).read_row_group(rg, columns=[self._text_column])
                try:
                    texts = table.column(0).to_pylist()
                except UnicodeDecodeError as e:
                    raise ValueError(f"column {self._text_column!r} (data.text_column) of "
                                     f"{self._groups.files[fi]!r}, row group {rg}: the text is not valid UTF-8 "
                                     f"({e})") from None
                if self._tokenizer is not None:  # only the rows this reader's blocks use
                    lo, hi = self._spans[gi]
                    texts = [None] * lo + _tokens_with_eos(self._tokenizer, texts[lo:hi]) + [None] * (len(texts) - hi)
                with self._lock:
                    self._cache_put(self._texts, gi, texts, self._window + 2)
                    self._loading.pop(gi, None)
        return texts

    def __getitem__(self, index):
        if isinstance(index, slice):
            return self.slice(index)
        if not self._infinite and not 0 <= index < self._n:
            raise IndexError(f"document index {index} out of range [0, {self._n})")
        gi, row = self._locate(int(index))
        return self._document(self._group_texts(gi)[row])

    def _document(self, row):
        """One cached row as the dataset's element: the text (a null cell is an empty document), or its tokens."""
        return row if self._tokenizer is not None else ("" if row is None else str(row))


def _tokens_with_eos(tokenizer: Tokenizer, texts: list) -> list[np.ndarray]:
    """Each text's tokens then EOS, int32 (a null cell is an empty document)."""
    ids = tokenizer.encode_batch(["" if t is None else str(t) for t in texts])
    return [np.asarray([*row, tokenizer.eos_id], dtype=np.int32) for row in ids]


def _as_tokens(tokens: np.ndarray) -> dict:
    return {"tokens": tokens}


def _to_example(row: dict) -> dict:
    """A packed row of T+1 tokens -> the model's inputs/targets/segments/positions/loss mask (length T)."""
    tokens = row["tokens"]
    seg = row["tokens_segment_ids"].astype(np.int32)
    pos = row["tokens_positions"].astype(np.int32)
    valid = (seg[:-1] == seg[1:]) & (seg[:-1] != 0)
    return {
        "inputs": tokens[:-1].astype(np.int32),
        "targets": tokens[1:].astype(np.int32),
        "segment_ids": seg[:-1],
        "positions": pos[:-1],
        "loss_mask": valid.astype(np.float32),
    }


def _slot_seed(seed: int, slot: int) -> int:
    """The shuffle seed of row slot ``slot``: depends on the run's seed and the slot only (not on hosts)."""
    return int(np.random.SeedSequence([int(seed), int(slot)]).generate_state(1)[0])


def _packed_rows(docs: grain.MapDataset, seq_len: int, *, threads: int = READ_THREADS,
                 prefetch: int = PREFETCH_DOCS) -> grain.IterDataset:
    """Documents given as token arrays (ending in EOS) -> packed rows of seq_len + 1 tokens -> examples."""
    tokens = docs.map(_as_tokens).to_iter_dataset(grain.ReadOptions(num_threads=threads, prefetch_buffer_size=prefetch))
    packed = ConcatThenSplitIterDataset(tokens, length_struct={"tokens": seq_len + 1})
    return packed.map(_to_example)


# ----------------------------------------------------------------------------------------------- state
def _jsonable(x):
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, np.ndarray):
        return x.tolist()
    return x


def _from_json(x):
    """Undoes what JSON does to grain's packer state: its ``remainder_slices`` must be tuples again."""
    if isinstance(x, dict):
        out = {}
        for k, v in x.items():
            if k == "remainder_slices" and isinstance(v, dict):
                out[k] = {kk: tuple(vv) for kk, vv in v.items()}
            else:
                out[k] = _from_json(v)
        return out
    if isinstance(x, list):
        return [_from_json(v) for v in x]
    return x


class _JsonStateIterator(grain.DatasetIterator):
    def __init__(self, parent: grain.DatasetIterator, fingerprint: dict):
        super().__init__(parent)
        self._fingerprint = fingerprint
        # Batches from grain worker processes live in shared memory: hand out private copies instead, so
        # that a batch kept by the caller does not pin (and, at exit, leak) a shared-memory block.
        self._copy = bool(fingerprint.get("num_workers"))
        # batches handed out from the start of the pipeline before every worker process has delivered a row
        # (see get_state): the first batch takes rows from all of them
        self._workers = 1 if fingerprint.get("num_workers") else 0
        self._from_start = 0

    def __next__(self):
        batch = next(self._parent)
        self._from_start += 1
        if self._copy:
            batch = {k: np.array(v, copy=True) for k, v in batch.items()}
        return batch

    def get_state(self) -> dict:
        """Plain JSON. Until every worker process has delivered a batch, the position is saved as a count of
        batches from the start instead of grain's state: grain (0.2.x) records a worker that has not delivered
        yet with the state of the whole interleave, which its set_state then rejects (IndexError), so a
        checkpoint from the first steps (e.g. a SIGTERM right after start) could not be resumed."""
        state = {"version": _STATE_VERSION, "pipeline": self._fingerprint}
        if self._from_start < self._workers:
            return state | {"batches_from_start": self._from_start}
        return state | {"grain": _jsonable(self._parent.get_state())}

    def set_state(self, state: dict) -> None:
        if isinstance(state, (str, bytes)):
            state = json.loads(state)
        if not isinstance(state, dict) or not ("grain" in state or "batches_from_start" in state):
            raise ValueError(f"data iterator state: expected a dict from get_state(), got {type(state).__name__}")
        old = state.get("pipeline", {})
        changed = {k: (old.get(k), v) for k, v in self._fingerprint.items() if old.get(k) != v}
        if changed:
            warnings.warn("data iterator state was saved by a different data pipeline; the batches after "
                          "resuming will not continue the original order. Changed (saved, now): "
                          + ", ".join(f"{k}={a!r}->{b!r}" for k, (a, b) in changed.items()), stacklevel=2)
        if "grain" in state:
            self._parent.set_state(_from_json(copy.deepcopy(state["grain"])))
            self._from_start = self._workers  # past the first batches: grain's own state from now on
            return
        if self._from_start:
            raise ValueError("data iterator state: a position counted from the start (batches_from_start) can "
                             "only be restored into a fresh iterator; this one has handed out "
                             f"{self._from_start} batches")
        for _ in range(int(state["batches_from_start"])):  # fewer than the worker processes: a cheap replay
            next(self)

    def __str__(self) -> str:
        return "_JsonStateIterator"


class _JsonStateIterDataset(grain.IterDataset):
    def __init__(self, parent: grain.IterDataset, fingerprint: dict):
        super().__init__(parent)
        self._fingerprint = fingerprint

    def __iter__(self) -> _JsonStateIterator:
        return _JsonStateIterator(self._parent.__iter__(), self._fingerprint)

    def __str__(self) -> str:
        return "_JsonStateIterDataset"


def _die_with_parent(worker_index: int = 0, worker_count: int = 0) -> None:
    """Runs in each grain worker: the kernel kills the worker when the trainer dies, even by SIGKILL (which
    runs no clean-up in the trainer). Linux only; elsewhere workers end when they next talk to the trainer."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    pr_set_pdeathsig = 1
    parent = os.getppid()
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, int(signal.SIGKILL), 0, 0, 0)
    if os.getppid() != parent:  # the trainer died before the line above (the worker was re-parented)
        os._exit(1)


def _mark_absl_flags_parsed() -> None:
    """grain's multiprocessing reads absl flags (defaults are fine); our entry point does not parse them."""
    from absl import flags

    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()


# ----------------------------------------------------------------------------------------------- public
def train_iterator(cfg, tokenizer: Tokenizer, *, global_batch_size: int, seed: int, process_index: int = 0,
                   process_count: int = 1) -> grain.DatasetIterator:
    """An endless iterator of packed training batches for this process (see the module docstring).

    ``get_state()`` is JSON-serialisable; ``set_state(state)`` resumes with exactly the batches that followed.
    """
    if process_count < 1 or not 0 <= process_index < process_count:
        raise ValueError(f"process_index={process_index} is not in [0, process_count={process_count})")
    if global_batch_size < 1 or global_batch_size % process_count:
        raise ValueError(f"train.batch_size: {global_batch_size} is not divisible by the process count "
                         f"{process_count} (each process loads batch_size // process_count sequences)")
    if cfg.seq_len < 1:
        raise ValueError(f"data.seq_len: must be >= 1, got {cfg.seq_len}")
    if getattr(cfg, "format", "text") == "pretokenized":  # token shards instead of Parquet text
        from mixerlab.training import pretokenized

        return batch_trace.maybe_trace(pretokenized.train_iterator(
            cfg, tokenizer, global_batch_size=global_batch_size, seed=seed, process_index=process_index,
            process_count=process_count), process_index)
    local_batch = global_batch_size // process_count
    files = resolve_parquet_files(cfg.train_path, "data.train_path", cfg.text_column)
    groups = _RowGroups(files)
    n = groups.num_docs
    if n < global_batch_size:
        raise ValueError(f"data.train_path: {cfg.train_path!r} has {n} documents, fewer than the "
                         f"{global_batch_size} rows of a batch (train.batch_size); every row reads its own "
                         f"slice of the documents")
    window = max(1, SHUFFLE_WINDOW_BLOCKS * 8 // global_batch_size)
    threads = max(1, READ_THREADS // local_batch)
    slots = []
    for r in range(process_index * local_batch, (process_index + 1) * local_batch):
        lo, hi = n * r // global_batch_size, n * (r + 1) // global_batch_size
        docs = _ParquetDocs(groups, groups.blocks(lo, hi), cfg.text_column,
                            seed=_slot_seed(seed, r) if cfg.shuffle else None, infinite=True, window_blocks=window,
                            tokenizer=tokenizer)
        slots.append(_packed_rows(docs, cfg.seq_len, threads=threads,
                                  prefetch=max(2, PREFETCH_DOCS // local_batch)))
    ds = InterleaveIterDataset(slots, cycle_length=local_batch)
    workers = _worker_count(int(cfg.num_workers or 0), local_batch)
    if workers > 0:
        # Worker w runs slots w, w+W, w+2W, ... and grain takes one row from each worker in turn, so the rows
        # arrive in slot order and the batch (made here, after the workers) is the in-process one.
        _mark_absl_flags_parsed()
        ds = ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=workers), worker_init_fn=_die_with_parent)
    ds = ds.batch(local_batch, drop_remainder=True)
    fingerprint = {"train_path": str(cfg.train_path), "seq_len": int(cfg.seq_len), "seed": int(seed),
                   "shuffle": bool(cfg.shuffle), "global_batch": global_batch_size, "local_batch": local_batch,
                   "process_index": process_index,
                   "process_count": process_count, "num_workers": workers,
                   "tokenizer": getattr(tokenizer, "name", type(tokenizer).__name__)}
    return batch_trace.maybe_trace(iter(_JsonStateIterDataset(ds, fingerprint)), process_index)


def _worker_count(requested: int, local_batch: int) -> int:
    """The most worker processes, up to ``requested`` (data.num_workers), that divide the local batch's rows:
    each worker owns every W-th row slot, and a worker without slots (W > rows) would fail, one with more slots
    than another (W not dividing the rows) would break the slot order."""
    return max((w for w in range(1, min(requested, local_batch) + 1) if local_batch % w == 0), default=0)


def eval_batches(cfg, tokenizer: Tokenizer, *, batch_size: int, max_batches: int,
                 path: str | None = None) -> list[dict]:
    """Up to ``max_batches`` packed batches of ``path`` (default ``cfg.val_path``), in file order, no shuffle.
    The last batch is padded to ``batch_size`` with empty rows (segment 0, loss_mask 0)."""
    key = "data.val_path"
    if path is None:
        path = cfg.val_path
    else:
        key = "eval path"
    if path is None:
        raise ValueError("data.val_path: is null; set it to a directory, .parquet file or glob to evaluate")
    if batch_size < 1:
        raise ValueError(f"eval batch_size must be >= 1, got {batch_size}")
    if getattr(cfg, "format", "text") == "pretokenized":
        from mixerlab.training import pretokenized

        return pretokenized.eval_batches(cfg, tokenizer, batch_size=batch_size, max_batches=max_batches, path=path,
                                         key=key)
    files = resolve_parquet_files(path, key, cfg.text_column)
    groups = _RowGroups(files)
    if groups.num_docs == 0 or max_batches <= 0:
        return []
    docs = _ParquetDocs(groups, groups.blocks(0, groups.num_docs), cfg.text_column, seed=None, infinite=False,
                        tokenizer=tokenizer)
    ds = _packed_rows(docs, cfg.seq_len).batch(batch_size, drop_remainder=False)
    out = []
    for batch in ds:
        b = batch["inputs"].shape[0]
        if b < batch_size:
            batch = {k: np.concatenate([v, np.zeros((batch_size - b,) + v.shape[1:], v.dtype)])
                     for k, v in batch.items()}
        out.append({k: batch[k] for k in BATCH_KEYS})
        if len(out) >= max_batches:
            break
    return out
