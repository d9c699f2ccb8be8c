"""The input pipeline over pre-tokenised ArrayRecord shards (``data.format: pretokenized``).

``python -m mixerlab.training.prepare_data ... --pretokenize`` writes ``<out>/tokens/<split>/part-NNNNN.array_record``
(one record per document: its int32 token ids, then EOS) and an ``index.json`` listing the shards, the
documents of every row group of the matching Parquet shard, and the tokenizer they were made with. Point
``data.train_path`` / ``data.val_path`` at such a directory.

The pipeline is ``training.data``'s with the tokenisation replaced by a record read: the same row slots, the
same per-epoch block and window shuffle (the blocks are the Parquet row groups recorded in the index), the
same packer, the same batch dict and the same JSON iterator state. Over the shards of one prepared corpus
the batches equal those of the text pipeline over its Parquet shards with the same tokenizer.
"""
from __future__ import annotations

import glob as _glob
import json
import os
import threading

import grain
import numpy as np
from grain.experimental import InterleaveIterDataset

from mixerlab.training import data as data_lib
from mixerlab.training.tokenizer import Tokenizer, resolve_path

INDEX = "index.json"
FORMAT = "mixerlab pretokenized"


def read_index(path: str, key: str) -> tuple[dict, list[str]]:
    """(index of a token-shard directory, the shard paths), checked; errors name the config ``key``. A glob
    (``/data/fw-*/tokens/train``) names several such directories, read in sorted order as one corpus (the
    order of the text glob ``/data/fw-*/train/*.parquet``); they must share one tokenizer."""
    if not path:
        raise ValueError(f"{key}: no path given (got {path!r}); with data.format=pretokenized it names a directory "
                         f"of .array_record shards written by training.prepare_data --pretokenize")
    if any(ch in path for ch in "*?["):
        roots = sorted(d for d in _glob.glob(os.path.expanduser(path)) if os.path.isfile(os.path.join(d, INDEX)))
        if not roots:
            raise FileNotFoundError(f"{key}: no directory with an {INDEX} matched the glob {path!r}")
        parts = [_read_one(root, root, key) for root in roots]
        index = dict(parts[0][0], docs=0, tokens=0, shards=[])
        for (one, files), root in zip(parts, roots):
            if one.get("tokenizer") != index.get("tokenizer"):
                raise ValueError(f"{key}: {root!r} was tokenised with {one.get('tokenizer')}, {roots[0]!r} with "
                                 f"{index.get('tokenizer')}; the directories of one glob need one tokenizer")
            index["docs"] += one.get("docs", 0)
            index["tokens"] += one.get("tokens", 0)
            index["shards"] += [dict(s, path=f) for s, f in zip(one["shards"], files)]
        return index, [s["path"] for s in index["shards"]]
    return _read_one(resolve_path(path, key), path, key)


def _read_one(root: str, path: str, key: str) -> tuple[dict, list[str]]:
    index_path = os.path.join(root, INDEX)
    if not os.path.isdir(root) or not os.path.isfile(index_path):
        raise FileNotFoundError(
            f"{key}: {path!r} has no {INDEX}; data.format=pretokenized reads a directory written by "
            f"`python -m training.prepare_data --pretokenize` (e.g. <out>/tokens/train), or set data.format=text "
            f"to read Parquet text")
    try:
        with open(index_path) as f:
            index = json.load(f)
    except ValueError as e:
        raise ValueError(f"{key}: {index_path!r} is not valid JSON ({e})") from None
    if not isinstance(index, dict) or index.get("format") != FORMAT or not isinstance(index.get("shards"), list):
        raise ValueError(f"{key}: {index_path!r} is not a token-shard index of training.prepare_data "
                         f"(format {FORMAT!r} with a shard list)")
    files = []
    for shard in index["shards"]:
        f = os.path.join(root, shard["path"])
        if not os.path.isfile(f):
            raise FileNotFoundError(f"{key}: {index_path!r} lists {shard['path']!r}, which is missing in {root!r}")
        if sum(shard["row_groups"]) != shard["docs"]:
            raise ValueError(f"{key}: {index_path!r}: the row groups of {shard['path']!r} do not add up to its "
                             f"{shard['docs']} documents")
        files.append(f)
    return index, files


def check_tokenizer(index: dict, tokenizer: Tokenizer, key: str) -> None:
    """The shards must hold ids of the configured tokenizer: same EOS id and vocabulary size."""
    made = index.get("tokenizer") or {}
    ours = {"eos_id": int(tokenizer.eos_id), "vocab_size": int(tokenizer.vocab_size)}
    diff = {k: (made.get(k), v) for k, v in ours.items() if made.get(k) != v}
    if diff:
        what = ", ".join(f"{k} {a} in the shards, {b} now" for k, (a, b) in diff.items())
        raise ValueError(f"{key}: the token shards were written with another tokenizer ({made.get('name')}) than "
                         f"data.tokenizer ({tokenizer.name}): {what}. Pretokenize again with this tokenizer, or "
                         f"set data.tokenizer to the one named in {INDEX}")


def check_token_data(path: str, key: str, tokenizer: Tokenizer | None = None) -> list[str]:
    """Start-up check (the counterpart of ``data.check_text_data``): the index, its shards and the tokenizer."""
    index, _ = read_index(path, key)
    if not index.get("docs"):
        raise ValueError(f"{key}: {path!r} holds no documents")
    if tokenizer is not None:
        check_tokenizer(index, tokenizer, key)
    return []


class _TokenGroups(data_lib._RowGroups):
    """(shard, row group, documents) of every row group, from the index (the Parquet row groups)."""

    def __init__(self, index: dict, files: list[str]):
        self.files = list(files)
        self.groups = []
        self.first_record: list[int] = []  # record index of each group's first document in its shard
        for fi, shard in enumerate(index["shards"]):
            offset = 0
            for rg, n in enumerate(shard["row_groups"]):
                if n:
                    self.groups.append((fi, rg, n))
                    self.first_record.append(offset)
                offset += n
        self.starts = np.cumsum([0] + [g[2] for g in self.groups]).tolist()
        self.num_docs = self.starts[-1]


class _TokenDocs(data_lib._ParquetDocs):
    """The token arrays (EOS included) of a slot's documents, in the order of ``_ParquetDocs``."""

    def _init_caches(self):
        super()._init_caches()
        self._readers: dict[int, object] = {}
        self._reader_lock = threading.Lock()

    def __getstate__(self):
        state = super().__getstate__()
        state.pop("_readers", None)
        state.pop("_reader_lock", None)
        return state

    def _group_texts(self, gi: int) -> list:  # the token arrays of row group gi (cached like the texts)
        with self._lock:
            rows = self._texts.get(gi)
            if rows is not None:
                self._texts.move_to_end(gi)
                return rows
        fi, _, n = self._groups.groups[gi]
        first = self._groups.first_record[gi]
        with self._reader_lock:  # one reader per shard, used by one thread at a time
            reader = self._readers.get(fi)
            if reader is None:
                from array_record.python.array_record_module import ArrayRecordReader

                reader = self._readers[fi] = ArrayRecordReader(self._groups.files[fi], "readahead_buffer_size:0")
            records = reader.read(first, first + n)
        rows = [np.frombuffer(r, "<i4").astype(np.int32) for r in records]
        with self._lock:
            self._cache_put(self._texts, gi, rows, self._window + 2)
        return rows

    def _document(self, tokens):  # the cached token array itself
        return tokens




def train_iterator(cfg, tokenizer: Tokenizer, *, global_batch_size: int, seed: int, process_index: int = 0,
                   process_count: int = 1) -> grain.DatasetIterator:
    """``data.train_iterator`` over token shards (same arguments, batches and state)."""
    if process_count < 1 or not 0 <= process_index < process_count:
        raise ValueError(f"process_index={process_index} is not in [0, process_count={process_count})")
    if global_batch_size < 1 or global_batch_size % process_count:
        raise ValueError(f"train.batch_size: {global_batch_size} is not divisible by the process count "
                         f"{process_count} (each process loads batch_size // process_count sequences)")
    local_batch = global_batch_size // process_count
    index, files = read_index(cfg.train_path, "data.train_path")
    check_tokenizer(index, tokenizer, "data.train_path")
    groups = _TokenGroups(index, files)
    n = groups.num_docs
    if n < global_batch_size:
        raise ValueError(f"data.train_path: {cfg.train_path!r} has {n} documents, fewer than the "
                         f"{global_batch_size} rows of a batch (train.batch_size); every row reads its own "
                         f"slice of the documents")
    window = max(1, data_lib.SHUFFLE_WINDOW_BLOCKS * 8 // global_batch_size)
    threads = max(1, data_lib.READ_THREADS // local_batch)
    slots = []
    for r in range(process_index * local_batch, (process_index + 1) * local_batch):
        lo, hi = n * r // global_batch_size, n * (r + 1) // global_batch_size
        docs = _TokenDocs(groups, groups.blocks(lo, hi), "tokens",
                          seed=data_lib._slot_seed(seed, r) if cfg.shuffle else None, infinite=True,
                          window_blocks=window)
        slots.append(data_lib._packed_rows(docs, cfg.seq_len, threads=threads,
                                  prefetch=max(2, data_lib.PREFETCH_DOCS // local_batch)))
    ds = InterleaveIterDataset(slots, cycle_length=local_batch).batch(local_batch, drop_remainder=True)
    if cfg.num_workers and cfg.num_workers > 0:
        data_lib._mark_absl_flags_parsed()
        ds = ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=int(cfg.num_workers)),
                            worker_init_fn=data_lib._die_with_parent)
    fingerprint = {"format": "pretokenized", "train_path": str(cfg.train_path), "seq_len": int(cfg.seq_len),
                   "seed": int(seed), "shuffle": bool(cfg.shuffle), "global_batch": global_batch_size,
                   "local_batch": local_batch, "process_index": process_index, "process_count": process_count,
                   "num_workers": int(cfg.num_workers or 0),
                   "tokenizer": getattr(tokenizer, "name", type(tokenizer).__name__)}
    return iter(data_lib._JsonStateIterDataset(ds, fingerprint))


def eval_batches(cfg, tokenizer: Tokenizer, *, batch_size: int, max_batches: int, path: str, key: str) -> list[dict]:
    """``data.eval_batches`` over token shards: file order, no shuffle, the last batch padded with empty rows."""
    index, files = read_index(path, key)
    check_tokenizer(index, tokenizer, key)
    groups = _TokenGroups(index, files)
    if groups.num_docs == 0 or max_batches <= 0:
        return []
    docs = _TokenDocs(groups, groups.blocks(0, groups.num_docs), "tokens", seed=None, infinite=False)
    out = []
    for batch in data_lib._packed_rows(docs, cfg.seq_len).batch(batch_size, drop_remainder=False):
        b = batch["inputs"].shape[0]
        if b < batch_size:
            batch = {k: np.concatenate([v, np.zeros((batch_size - b,) + v.shape[1:], v.dtype)])
                     for k, v in batch.items()}
        out.append({k: batch[k] for k in data_lib.BATCH_KEYS})
        if len(out) >= max_batches:
            break
    return out
