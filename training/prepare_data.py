"""Corpus -> Parquet shards in FineWeb-Edu's ``text`` schema (train/ and val/), a manifest, and optionally
pre-tokenised ArrayRecord shards.

    python -m mixerlab.training.prepare_data --source SRC --out DIR [--text_column text] [--val_fraction 0.01]
        [--shard_docs 100000] [--row_group_docs 1000] [--max_docs N] [--tokenizer tokenizer.json --pretokenize]
    python -m mixerlab.training.prepare_data --out DIR --tokenize_only --tokenizer tokenizer.json   # add tokens/ later

``SRC`` is a Parquet or JSONL file (``.jsonl``/``.jsonl.gz``), a directory of them, a glob, or a HuggingFace
dataset ``hf://OWNER/NAME?name=CONFIG&split=train`` (streamed through ``datasets``; needs the network). Files
are read through ``etils.epath``, so ``gs://`` and other fsspec paths work wherever their filesystem package is
installed (gcsfs for gs://).

Output (DIR)::

    train/part-00000.parquet ...   columns text (string), id (string); row groups of --row_group_docs documents
    val/part-00000.parquet ...
    tokens/train/part-00000.array_record ...   with --pretokenize: ONE RECORD PER DOCUMENT, the document's
    tokens/val/...                             token ids then the tokenizer's EOS id, as little-endian int32
    tokens/<split>/index.json                  shards, documents per row group, tokenizer fingerprint
    manifest.json                              source, counts of documents/bytes/tokens, shard list with sha256

Why one record per document and not packed rows: packing stays in the trainer (``training.data``), so one set
of token shards serves every ``data.seq_len`` and batch size, and the batches are exactly those of the text
pipeline over ``DIR/train`` (token shards mirror the Parquet shards document for document and row group for
row group, so even the shuffle order is the same). ``--seq_len`` only adds to the manifest how many packed
rows of that length the tokens fill.

The split is by hash: a document goes to val when the first 8 bytes of sha256(id or text) / 2**64 are below
``--val_fraction``; it depends on the document alone, not on the order or the number of workers.
"""
from __future__ import annotations

import argparse
import datetime
import gzip
import hashlib
import io
import json
import os
import sys
import tempfile
import urllib.parse
from typing import Iterator, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from mixerlab.training.cli_errors import entry_point

TOOL_VERSION = 1
SPLITS = ("train", "val")
DATA_SUFFIXES = (".parquet", ".jsonl", ".jsonl.gz", ".json")
TOKEN_SHARD_SUFFIX = ".array_record"
TOKEN_INDEX = "index.json"
MANIFEST = "manifest.json"
SCHEMA = pa.schema([("text", pa.string()), ("id", pa.string())])


def write_documents(where, texts: list[str], ids: list[str], row_group_docs: int) -> None:
    """One Parquet file of documents (``text``, ``id``; zstd) to a path or an open binary file."""
    table = pa.table({"text": pa.array(texts, pa.string()), "id": pa.array(ids, pa.string())}, schema=SCHEMA)
    pq.write_table(table, where, row_group_size=row_group_docs, compression="zstd")


class PrepareError(ValueError):
    """A bad source, flag or output; the message names the thing and what would be valid."""


def epath(path: str):
    from etils import epath as _epath

    return _epath.Path(path)


# ----------------------------------------------------------------------------------------------- sources
def _has_glob(path: str) -> bool:
    return any(ch in path for ch in "*?[")


def resolve_source_files(source: str, flag: str = "--source") -> list:
    """The data files of a file, directory (not its subdirectories) or glob (sorted), as epath Paths."""
    if _has_glob(source):
        parts = source.split("/")
        first = next(i for i, p in enumerate(parts) if _has_glob(p))
        root = "/".join(parts[:first]) or ("/" if source.startswith("/") else ".")
        files = sorted(p for p in epath(root).glob("/".join(parts[first:])) if p.is_file())
        if not files:
            raise PrepareError(f"{flag}: no file matched the glob {source!r}")
        return files
    path = epath(source)
    if not path.exists():
        raise PrepareError(f"{flag}: {source!r} does not exist (a Parquet/JSONL file, a directory of them, a glob "
                           f"or hf://OWNER/NAME?name=CONFIG)")
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.is_file() and p.name.endswith(DATA_SUFFIXES))
        if not files:
            raise PrepareError(f"{flag}: the directory {source!r} holds no {', '.join(DATA_SUFFIXES)} file")
        return files
    return [path]


def _parquet_docs(path, text_column: str) -> Iterator[tuple[str | None, str | None]]:
    with path.open("rb") as f:
        pf = pq.ParquetFile(f)
        names = pf.schema_arrow.names
        if text_column not in names:
            raise PrepareError(f"--text_column: {str(path)!r} has no column {text_column!r}; its columns are {names}")
        columns = [text_column] + (["id"] if "id" in names and text_column != "id" else [])
        for rg in range(pf.num_row_groups):
            table = pf.read_row_group(rg, columns=columns)
            texts = table.column(0).to_pylist()
            ids = table.column(1).to_pylist() if len(columns) > 1 else [None] * len(texts)
            yield from zip(texts, ids)


def _jsonl_docs(path, text_column: str) -> Iterator[tuple[str | None, str | None]]:
    with path.open("rb") as raw:
        stream = gzip.open(raw, "rt", encoding="utf-8") if path.name.endswith(".gz") else \
            io.TextIOWrapper(raw, encoding="utf-8")
        for i, line in enumerate(stream, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as e:
                raise PrepareError(f"--source: {str(path)!r} line {i} is not JSON ({e})") from None
            if not isinstance(row, dict) or text_column not in row:
                raise PrepareError(f"--text_column: {str(path)!r} line {i} has no field {text_column!r}")
            doc_id = row.get("id")
            yield row[text_column], None if doc_id is None else str(doc_id)


def _parse_hf(source: str) -> tuple[str, dict]:
    parsed = urllib.parse.urlparse(source)
    repo = (parsed.netloc + parsed.path).strip("/")
    if repo.count("/") != 1:
        raise PrepareError(f"--source: {source!r}: expected hf://OWNER/NAME[?name=CONFIG&split=SPLIT], e.g. "
                           f"hf://HuggingFaceFW/fineweb-edu?name=sample-10BT")
    query = dict(urllib.parse.parse_qsl(parsed.query))
    unknown = set(query) - {"name", "split", "data_dir", "data_files", "revision"}
    if unknown:
        raise PrepareError(f"--source: {source!r}: unknown option(s) {sorted(unknown)}; valid: name, split, data_dir, "
                           f"data_files, revision")
    query.setdefault("split", "train")
    return repo, query


def _hf_docs(source: str, text_column: str) -> Iterator[tuple[str | None, str | None]]:
    repo, options = _parse_hf(source)
    try:
        import datasets
    except ImportError:
        raise PrepareError("--source: hf:// sources need the `datasets` package (pip install datasets)") from None
    try:
        ds = datasets.load_dataset(repo, streaming=True, **options)
    except Exception as e:  # offline (ConnectionError, OfflineModeIsEnabled), unknown dataset or config
        offline = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("HF_DATASETS_OFFLINE")
        hint = (" HF_HUB_OFFLINE/HF_DATASETS_OFFLINE is set: streaming needs the network; unset it, or download the "
                "Parquet files elsewhere and pass their directory or bucket path" if offline else
                " Check the network, the dataset name and its config (name=...); or pass a local/bucket path "
                "of its Parquet files")
        raise PrepareError(f"--source: cannot stream {repo} ({options}): {type(e).__name__}: {str(e)[:300]}.{hint}") \
            from None
    for row in ds:
        if text_column not in row:
            raise PrepareError(f"--text_column: {repo} has no field {text_column!r}; its fields are {sorted(row)}")
        doc_id = row.get("id")
        yield row[text_column], None if doc_id is None else str(doc_id)


def iter_documents(source: str, text_column: str = "text", flag: str = "--source"
                   ) -> tuple[Iterator[tuple[str, str]], int | None]:
    """(iterator of (text, id), number of documents when known from metadata). Empty and null texts are kept
    as "" (the trainer counts them); a missing id becomes ``<source file name>:<row>``."""
    if source.startswith("hf://"):
        _parse_hf(source)  # flag errors before any network access
        return _with_ids(_hf_docs(source, text_column), source.split("?")[0]), None
    files = resolve_source_files(source, flag)
    total = 0
    for f in files:
        if f.name.endswith(".parquet"):
            with f.open("rb") as fh:
                total += pq.ParquetFile(fh).metadata.num_rows
        else:
            total = None
            break

    def docs():
        for f in files:
            reader = _parquet_docs if f.name.endswith(".parquet") else _jsonl_docs
            yield from _with_ids(reader(f, text_column), f.name)

    return docs(), total


def _with_ids(rows, origin: str):
    for i, (text, doc_id) in enumerate(rows):
        if text is not None and not isinstance(text, str):
            raise PrepareError(f"--text_column: document {i} of {origin} is a {type(text).__name__}, not text")
        yield ("" if text is None else text), (str(doc_id) if doc_id is not None else f"{origin}:{i}")


def is_val(doc_id: str, text: str, val_fraction: float) -> bool:
    """The hash split (see the module docstring)."""
    if val_fraction <= 0:
        return False
    digest = hashlib.sha256((doc_id or text).encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2 ** 64 < val_fraction


# ----------------------------------------------------------------------------------------------- writers
def sha256_of(path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


class _SplitWriter:
    """Parquet shards (and token shards) of one split, flushed every ``shard_docs`` documents."""

    def __init__(self, out, split: str, *, shard_docs: int, row_group_docs: int, tokenizer=None):
        self.out, self.split = out, split
        self.shard_docs, self.row_group_docs = shard_docs, row_group_docs
        self.tokenizer = tokenizer
        self.texts: list[str] = []
        self.ids: list[str] = []
        self.shards: list[dict] = []
        self.token_shards: list[dict] = []
        self.docs = self.bytes = self.tokens = 0

    def add(self, text: str, doc_id: str) -> None:
        self.texts.append(text)
        self.ids.append(doc_id)
        if len(self.texts) >= self.shard_docs:
            self.flush()

    def flush(self) -> None:
        if not self.texts:
            return
        name = f"part-{len(self.shards):05d}"
        n = len(self.texts)
        nbytes = sum(len(t.encode("utf-8")) for t in self.texts)
        path = self.out / self.split / f"{name}.parquet"
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("wb") as f:
            write_documents(f, self.texts, self.ids, self.row_group_docs)
        with path.open("rb") as f:  # as written (pyarrow may cut row groups smaller than asked)
            md = pq.ParquetFile(f).metadata
            groups = [md.row_group(i).num_rows for i in range(md.num_row_groups)]
        shard = {"path": f"{self.split}/{name}.parquet", "docs": n, "bytes": nbytes, "row_groups": groups,
                 "sha256": sha256_of(path)}
        if self.tokenizer is not None:
            shard["tokens"] = self._write_tokens(name, groups)
        self.shards.append(shard)
        self.docs += n
        self.bytes += nbytes
        self.texts, self.ids = [], []

    def _write_tokens(self, name: str, groups: list[int]) -> int:
        from array_record.python.array_record_module import ArrayRecordWriter

        dest = self.out / "tokens" / self.split / f"{name}{TOKEN_SHARD_SUFFIX}"
        dest.parent.mkdir(parents=True, exist_ok=True)
        eos = self.tokenizer.eos_id
        count = 0
        with tempfile.TemporaryDirectory() as tmp:  # ArrayRecord writes local files; copied to dest after
            local = os.path.join(tmp, dest.name)
            writer = ArrayRecordWriter(local, "group_size:1")  # every record readable alone (random access)
            for lo in range(0, len(self.texts), 1024):
                for ids in self.tokenizer.encode_batch(self.texts[lo:lo + 1024]):
                    row = np.empty(len(ids) + 1, "<i4")
                    row[:-1] = ids
                    row[-1] = eos
                    writer.write(row.tobytes())
                    count += len(row)
            writer.close()
            with open(local, "rb") as src, dest.open("wb") as dst:
                while chunk := src.read(1 << 24):
                    dst.write(chunk)
        self.token_shards.append({"path": dest.name, "docs": len(self.texts), "tokens": count,
                                  "row_groups": groups, "sha256": sha256_of(dest)})
        self.tokens += count
        return count

    def summary(self) -> dict:
        return {"docs": self.docs, "bytes": self.bytes, "tokens": self.tokens if self.tokenizer else None,
                "shards": self.shards}


def tokenizer_fingerprint(tokenizer, path: str | None) -> dict:
    return {"name": tokenizer.name, "vocab_size": int(tokenizer.vocab_size), "eos_id": int(tokenizer.eos_id),
            "sha256": sha256_of(epath(path)) if path else None}


# ----------------------------------------------------------------------------------------------- main
def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m mixerlab.training.prepare_data", description=__doc__.split("\n\n")[0])
    ap.add_argument("--source", help="Parquet/JSONL file, directory, glob, or hf://OWNER/NAME?name=X")
    ap.add_argument("--out", required=True, help="output directory (local path or bucket URL)")
    ap.add_argument("--text_column", default="text")
    ap.add_argument("--val_fraction", type=float, default=0.01, help="share of documents for val/ (hash split)")
    ap.add_argument("--shard_docs", type=int, default=100_000, help="documents per output shard")
    ap.add_argument("--row_group_docs", type=int, default=1000, help="documents per Parquet row group")
    ap.add_argument("--max_docs", type=int, default=None, help="stop after this many source documents")
    ap.add_argument("--tokenizer", default=None, help="tokenizer.json (HF) used by --pretokenize")
    ap.add_argument("--tokenizer_kind", default="hf", help="hf | sentencepiece | byte (default hf)")
    ap.add_argument("--pretokenize", action="store_true", help="also write ArrayRecord token shards (tokens/)")
    ap.add_argument("--tokenize_only", action="store_true",
                    help="add token shards to the corpus already prepared in --out (no --source; its manifest's "
                         "shards are tokenised as they are, so a tokenizer trained on them can be used)")
    ap.add_argument("--seq_len", type=int, default=None, help="report packed rows of this length in the manifest")
    ap.add_argument("--overwrite", action="store_true", help="write into an --out that already holds a manifest")
    ap.add_argument("--no_progress", action="store_true")
    return ap


def _check(args, ap) -> None:
    if args.tokenize_only:
        if args.source is not None:
            ap.error("--tokenize_only reads the corpus in --out; leave out --source")
        args.pretokenize = True
    elif args.source is None:
        ap.error("--source is required (or --tokenize_only to add token shards to a prepared --out)")
    if not 0 <= args.val_fraction < 1:
        ap.error(f"--val_fraction: must be in [0, 1), got {args.val_fraction}")
    for flag in ("shard_docs", "row_group_docs"):
        if getattr(args, flag) < 1:
            ap.error(f"--{flag}: must be >= 1, got {getattr(args, flag)}")
    if args.max_docs is not None and args.max_docs < 1:
        ap.error(f"--max_docs: must be >= 1, got {args.max_docs}")
    if args.seq_len is not None and args.seq_len < 1:
        ap.error(f"--seq_len: must be >= 1, got {args.seq_len}")
    if args.pretokenize and args.tokenizer is None and args.tokenizer_kind != "byte":
        ap.error("--pretokenize needs --tokenizer PATH (a tokenizer.json; train one with training.train_tokenizer)")
    if args.seq_len is not None and not args.pretokenize:
        ap.error("--seq_len: only meaningful with --pretokenize (it reports packed rows of the token shards)")


@entry_point("mixerlab-prepare-data")
def main(argv: Sequence[str] | None = None) -> int:
    ap = _parser()
    args = ap.parse_args(argv)
    _check(args, ap)
    try:
        manifest = tokenize_prepared(args) if args.tokenize_only else prepare(args)
    except PrepareError as e:
        print(f"training.prepare_data: {e}", file=sys.stderr)
        return 2
    counts = ", ".join(f"{s}: {manifest['splits'][s]['docs']} docs, {manifest['splits'][s]['bytes']:,} bytes"
                       + (f", {manifest['splits'][s]['tokens']:,} tokens" if manifest['splits'][s]['tokens']
                          is not None else "") for s in SPLITS)
    print(f"wrote {args.out} ({counts}); manifest {epath(args.out) / MANIFEST}")
    return 0


def _load_tokenizer(args):
    from mixerlab.training.tokenizer import load_tokenizer

    try:
        return load_tokenizer(args.tokenizer_kind, args.tokenizer)
    except (ValueError, FileNotFoundError) as e:
        raise PrepareError(f"--tokenizer: {e}") from None


def _write_token_index(out, manifest: dict, writers: dict, seq_len: int | None) -> None:
    manifest["tokens"] = {}
    for s, w in writers.items():
        index = {"format": "mixerlab pretokenized", "version": TOOL_VERSION, "record": "int32 little-endian "
                 "token ids of one document followed by eos_id", "tokenizer": manifest["tokenizer"],
                 "docs": w.docs, "tokens": w.tokens, "shards": w.token_shards}
        if w.token_shards:
            (out / "tokens" / s).mkdir(parents=True, exist_ok=True)
            (out / "tokens" / s / TOKEN_INDEX).write_text(json.dumps(index, indent=1))
        manifest["tokens"][s] = {"dir": f"tokens/{s}", "docs": w.docs, "tokens": w.tokens}
        if seq_len:
            manifest["tokens"][s]["rows_at_seq_len"] = {"seq_len": seq_len, "rows": w.tokens // (seq_len + 1)}


def tokenize_prepared(args) -> dict:
    """--tokenize_only: token shards for every Parquet shard listed in ``--out``'s manifest (same order and
    row groups); the manifest gains the token counts and the tokenizer."""
    from tqdm import tqdm

    out = epath(args.out)
    try:
        manifest = json.loads((out / MANIFEST).read_text())
    except FileNotFoundError:
        raise PrepareError(f"--out: {args.out!r} has no {MANIFEST}; prepare it first (--source ...)") from None
    tokenizer = _load_tokenizer(args)
    writers = {}
    total = sum(manifest["splits"][s]["docs"] for s in SPLITS)
    bar = tqdm(total=total, unit="doc", desc="tokenize", disable=args.no_progress, file=sys.stderr)
    for split in SPLITS:
        w = writers[split] = _SplitWriter(out, split, shard_docs=1, row_group_docs=1, tokenizer=tokenizer)
        for shard in manifest["splits"][split]["shards"]:
            path = out / shard["path"]
            if sha256_of(path) != shard["sha256"]:
                raise PrepareError(f"--out: {str(path)!r} does not match the sha256 in {MANIFEST} (changed since it "
                                   f"was written); prepare the corpus again")
            with path.open("rb") as f:
                w.texts = [t or "" for t in pq.read_table(f, columns=["text"]).column(0).to_pylist()]
            shard["tokens"] = w._write_tokens(path.name[:-len(".parquet")], shard["row_groups"])
            w.docs += len(w.texts)
            bar.update(len(w.texts))
            w.texts = []
        manifest["splits"][split]["tokens"] = w.tokens
    bar.close()
    manifest["tokenizer"] = tokenizer_fingerprint(tokenizer, args.tokenizer)
    _write_token_index(out, manifest, writers, args.seq_len)
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1))
    return manifest


def prepare(args) -> dict:
    from tqdm import tqdm

    out = epath(args.out)
    if (out / MANIFEST).exists() and not args.overwrite:
        raise PrepareError(f"--out: {args.out!r} already holds {MANIFEST} (a prepared corpus); pass --overwrite or "
                           f"choose another directory")
    tokenizer = _load_tokenizer(args) if args.pretokenize else None
    docs, total = iter_documents(args.source, args.text_column)
    if args.max_docs is not None:
        total = min(total, args.max_docs) if total is not None else args.max_docs
    writers = {s: _SplitWriter(out, s, shard_docs=args.shard_docs, row_group_docs=args.row_group_docs,
                               tokenizer=tokenizer) for s in SPLITS}
    bar = tqdm(total=total, unit="doc", desc="prepare_data", disable=args.no_progress, file=sys.stderr)
    seen = 0
    try:
        for text, doc_id in docs:
            writers["val" if is_val(doc_id, text, args.val_fraction) else "train"].add(text, doc_id)
            seen += 1
            bar.update(1)
            if args.max_docs is not None and seen >= args.max_docs:
                break
        for w in writers.values():
            w.flush()
    finally:
        bar.close()  # before an error message, not after it
    if seen == 0:
        raise PrepareError(f"--source: {args.source!r} holds no documents")
    manifest = {
        "tool": "mixerlab training.prepare_data", "tool_version": TOOL_VERSION,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "source": args.source, "text_column": args.text_column, "val_fraction": args.val_fraction,
        "split_rule": "val if sha256(id or text)[:8] / 2**64 < val_fraction", "row_group_docs": args.row_group_docs,
        "schema": {"text": "string", "id": "string"},
        "splits": {s: w.summary() for s, w in writers.items()},
        "tokenizer": tokenizer_fingerprint(tokenizer, args.tokenizer) if tokenizer else None,
    }
    if tokenizer is not None:
        _write_token_index(out, manifest, writers, args.seq_len)
    out.mkdir(parents=True, exist_ok=True)
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1))
    return manifest


if __name__ == "__main__":
    sys.exit(main())
