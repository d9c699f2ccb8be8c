#!/usr/bin/env python
"""Rebuild the embedded default corpus (data/embedded/) and train its tokenizer, in one command.

    JAX_PLATFORMS=cpu .venv/bin/python tools/build_embedded_corpus.py [--out data/embedded]

Source: the documentation that ships with the running CPython interpreter (PSF licence):
  * `pydoc_data.topics.topics`: the Language Reference help topics (one document per topic);
  * the docstrings of the public standard-library modules (one document per module: module docstring
    plus its public classes'/functions' docstrings under headings; a class with a lot of documentation
    gets a page of its own, as API reference sites do).

Output (FineWeb-Edu's Parquet schema, zstd):
  data/embedded/train/part-00000.parquet, data/embedded/val/part-00000.parquet, data/embedded/tokenizer.json
  (byte-level BPE, vocab 8192, special token "<|endoftext|>", trained on the train split only) and
  data/embedded/README.md (source, licence, sizes, checksums).

Deterministic: sorted module order, no timestamps, no memory addresses; re-running on the same Python
(and the same pyarrow/tokenizers versions) gives byte-identical files. The split is a hash of the document id.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib
import inspect
import io
import math
import os
import pkgutil
import re
import sys
import time
import warnings
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO_ROOT / "data" / "embedded"

PY_VERSION = "{}.{}.{}".format(*sys.version_info[:3])
PY_MINOR = "{}.{}".format(*sys.version_info[:2])
DUMP = f"python-{PY_VERSION}-docs"
# Release date of the interpreter's docs would be nicer, but the build must not depend on the clock:
# one fixed date (Python 3.11.7's release day) for every row.
DATE = "2023-12-04T00:00:00Z"
EOS_TOKEN = "<|endoftext|>"
VOCAB_SIZE = 8192

# Top-level modules never imported: side effects on import (antigravity opens a browser, this prints),
# GUI toolkits / IDE code (noisy option lists), lib2to3 (grammar tables, writes pickles), the test suite,
# and distutils (a venv may redirect it to setuptools' copy, which is not PSF text).
SKIP_TOP = {
    "antigravity", "this", "idlelib", "tkinter", "turtledemo", "lib2to3", "test", "pydoc_data",
    "encodings", "ensurepip", "distutils", "xxsubtype", "xxlimited", "xxlimited_35",
}
MIN_DOCSTRING_CHARS = 40      # a single docstring shorter than this is skipped ("Return self.")
MIN_DOCUMENT_CHARS = 200      # a document shorter than this is skipped
CLASS_PAGE_CHARS = 2000       # a class with at least this much documentation gets its own page
VAL_FRACTION = 0.03
VAL_MIN_DOCS = 50
ROW_GROUP_SIZE = 64           # several row groups per file: lets readers stream and shuffle by block

_ADDRESS = re.compile(r"0x[0-9a-fA-F]{4,}")


def _doc(obj) -> str:
    d = getattr(obj, "__doc__", None)
    if not isinstance(d, str):
        return ""
    d = inspect.cleandoc(d).strip()
    return d if len(d) >= MIN_DOCSTRING_CHARS and not _ADDRESS.search(d) else ""


def _signature(name: str, obj) -> str:
    try:
        sig = str(inspect.signature(obj))
    except Exception:  # C functions without a text signature (their docstring usually starts with one)
        return name
    if _ADDRESS.search(sig) or len(sig) > 200:
        return name
    return name + sig


def _heading(text: str, ch: str) -> str:
    return f"{text}\n{ch * len(text)}"


def _public_name(name: str) -> bool:
    parts = name.split(".")
    if any(p.startswith("_") for p in parts):
        return False
    if any(p in ("test", "tests", "testing") or p.startswith("test_") for p in parts):
        return False
    return True


def _stdlib_dir() -> str:
    return os.path.dirname(os.__file__)


def _quiet_import(name: str):
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()), \
            contextlib.redirect_stderr(io.StringIO()):
        warnings.simplefilter("ignore")
        return importlib.import_module(name)


def _in_stdlib(mod) -> bool:
    f = getattr(mod, "__file__", None)
    if f is None:  # built into the interpreter (sys, builtins, ...)
        return mod.__name__ in sys.builtin_module_names
    return os.path.abspath(f).startswith(_stdlib_dir() + os.sep)


def collect_modules() -> dict:
    """Imports the public standard-library modules and their public submodules, sorted by name."""
    mods = {}
    for top in sorted(sys.stdlib_module_names):
        if top in SKIP_TOP or not _public_name(top):
            continue
        try:
            m = _quiet_import(top)
        except Exception:  # platform modules (winreg, msvcrt, ...) or missing optional C libraries
            continue
        if not _in_stdlib(m):
            continue
        mods[top] = m
        stack = [(list(getattr(m, "__path__", [])), top)]
        while stack:
            path, prefix = stack.pop()
            if not path:
                continue
            for info in sorted(pkgutil.iter_modules(path, prefix + "."), key=lambda i: i.name):
                if not _public_name(info.name):
                    continue
                try:
                    sm = _quiet_import(info.name)
                except Exception:
                    continue
                if not _in_stdlib(sm):
                    continue
                mods[info.name] = sm
                if info.ispkg:
                    stack.append((list(getattr(sm, "__path__", [])), info.name))
    return dict(sorted(mods.items()))


def _class_section(qual: str, cls, level: str) -> str:
    parts = [_heading(f"class {qual}", level)]
    d = _doc(cls)
    if d:
        parts.append(d)
    seen = {d}
    for mname in sorted(vars(cls)):
        if mname.startswith("_") and mname != "__init__":
            continue
        member = vars(cls)[mname]
        if isinstance(member, (staticmethod, classmethod)):
            member = member.__func__
        if not (inspect.isroutine(member) or isinstance(member, property)
                or inspect.isdatadescriptor(member)):
            continue
        md = _doc(member)
        if not md or md in seen:
            continue
        seen.add(md)
        title = _signature(f"{qual}.{mname}", member) if inspect.isroutine(member) else f"{qual}.{mname}"
        parts.append(f"{title}\n\n{md}")
    return "\n\n".join(parts)


def _source_path(mod) -> str:
    f = getattr(mod, "__file__", None)
    if f is None:
        return f"python-{PY_VERSION}/built-in/{mod.__name__}"
    rel = os.path.relpath(os.path.abspath(f), _stdlib_dir())
    return f"python-{PY_VERSION}/Lib/{rel}"


def _private_module(modname) -> bool:
    return isinstance(modname, str) and any(p.startswith("_") for p in modname.split("."))


def assign_owners(mods: dict) -> dict:
    """Maps id(obj) -> public module name for public classes/functions defined in private modules.

    `_io.TextIOWrapper` is documented under `io`, `_heapq.heappush` under `heapq`: the owner is the public
    module named like the private one without underscores, else the first public module (sorted) that
    re-exports the object. Each object is documented once.
    """
    owners = {}
    for name, mod in mods.items():
        for attr in sorted(vars(mod)):
            obj = vars(mod)[attr]
            if attr.startswith("_") or not (inspect.isclass(obj) or inspect.isroutine(obj)):
                continue
            home = getattr(obj, "__module__", None)
            if not _private_module(home):
                continue
            natural = ".".join(p.lstrip("_") for p in home.split("."))
            if natural in mods:
                owners[id(obj)] = natural
            else:
                owners.setdefault(id(obj), name)
    return owners


def module_documents(name: str, mod, owners: dict | None = None) -> list[dict]:
    """One page for the module, plus one per heavily documented class."""
    owners = owners or {}
    pages = []
    body = [_heading(f"{name} module", "=")]
    mdoc = _doc(mod)
    if mdoc:
        body.append(mdoc)
    seen = {mdoc}
    ns = vars(mod)
    classes, functions = [], []
    for attr in sorted(ns):
        if attr.startswith("_"):
            continue
        obj = ns[attr]
        if getattr(obj, "__module__", None) != name and owners.get(id(obj)) != name:
            continue  # re-exported from elsewhere: documented there
        if inspect.isclass(obj):
            classes.append((attr, obj))
        elif inspect.isroutine(obj):
            functions.append((attr, obj))
    url = f"https://docs.python.org/{PY_MINOR}/library/{name}.html"
    for attr, cls in classes:
        cdoc = _doc(cls)
        if cdoc in seen and cdoc:
            continue
        seen.add(cdoc)
        section = _class_section(attr, cls, "-")
        if len(section) >= CLASS_PAGE_CHARS:
            page = _heading(f"{name}.{attr}", "=") + "\n\n" + _class_section(f"{name}.{attr}", cls, "-")
            pages.append(dict(kind="class", key=f"{name}.{attr}", text=page,
                              url=f"{url}#{name}.{attr}", file_path=_source_path(mod)))
            first = cdoc.split("\n\n", 1)[0] if cdoc else ""
            body.append(_heading(f"class {attr}", "-") + ("\n\n" + first if first else "")
                        + f"\n\nSee the page for {name}.{attr}.")
        elif cdoc or section.count("\n\n") > 0:
            body.append(section)
    if functions:
        fparts = []
        for attr, fn in functions:
            fd = _doc(fn)
            if not fd or fd in seen:
                continue
            seen.add(fd)
            fparts.append(f"{_signature(attr, fn)}\n\n{fd}")
        if fparts:
            body.append(_heading("Functions", "-"))
            body.extend(fparts)
    text = "\n\n".join(body)
    if len(text) - len(body[0]) >= MIN_DOCUMENT_CHARS:
        pages.insert(0, dict(kind="module", key=name, text=text, url=url, file_path=_source_path(mod)))
    return [p for p in pages if len(p["text"]) >= MIN_DOCUMENT_CHARS]


def topic_documents() -> list[dict]:
    from pydoc_data import topics
    docs = []
    for key in sorted(topics.topics):
        text = topics.topics[key].strip()
        if len(text) < MIN_DOCUMENT_CHARS:
            continue
        docs.append(dict(kind="topic", key=key, text=text,
                         url=f"https://docs.python.org/{PY_MINOR}/reference/#{key}",
                         file_path=f"python-{PY_VERSION}/Lib/pydoc_data/topics.py"))
    return docs


def collect_documents() -> list[dict]:
    docs = topic_documents()
    mods = collect_modules()
    owners = assign_owners(mods)
    for name, mod in mods.items():
        docs.extend(module_documents(name, mod, owners))
    out, ids = [], set()
    for d in docs:
        doc_id = f"<urn:pydoc:{d['kind']}:{d['key']}>"
        if doc_id in ids:
            continue
        ids.add(doc_id)
        d["id"] = doc_id
        d["hash"] = hashlib.sha256(doc_id.encode("utf-8")).hexdigest()
        out.append(d)
    out.sort(key=lambda d: d["hash"])  # crawl-like order: a stable pseudo-random permutation
    return out


def split_documents(docs: list[dict]) -> tuple[list[dict], list[dict]]:
    """The first max(3%, 50) documents in hash order go to val, the rest to train."""
    n_val = min(len(docs) // 2, max(math.ceil(VAL_FRACTION * len(docs)), VAL_MIN_DOCS))
    return docs[n_val:], docs[:n_val]


def train_tokenizer(texts: list[str]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE, min_frequency=2, special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return tok


def write_parquet(docs: list[dict], token_counts: list[int], path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq
    schema = pa.schema([
        ("text", pa.string()), ("id", pa.string()), ("dump", pa.string()), ("url", pa.string()),
        ("date", pa.string()), ("file_path", pa.string()), ("language", pa.string()),
        ("language_score", pa.float64()), ("token_count", pa.int64()), ("score", pa.float64()),
        ("int_score", pa.int64()),
    ])
    n = len(docs)
    table = pa.table({
        "text": [d["text"] for d in docs],
        "id": [d["id"] for d in docs],
        "dump": [DUMP] * n,
        "url": [d["url"] for d in docs],
        "date": [DATE] * n,
        "file_path": [d["file_path"] for d in docs],
        "language": ["en"] * n,
        "language_score": [1.0] * n,
        "token_count": token_counts,
        "score": [3.0] * n,
        "int_score": [3] * n,
    }, schema=schema)
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, path, compression="zstd", row_group_size=ROW_GROUP_SIZE)


README_TEMPLATE = """\
# Embedded default corpus

A small English corpus that ships with mixerlab so that `make train` and the tests run with no download.
It has FineWeb-Edu's Parquet schema, so any FineWeb-Edu shard can replace it (`data.train_path`, `data.val_path`).
This file is written by `tools/build_embedded_corpus.py`; do not edit it by hand.

## Source and licence

The text is the documentation that ships with CPython {py_version} (the interpreter that built it):

* `pydoc_data/topics.py`: the Language Reference help topics (`help("assignment")` etc.), one document per topic;
* the docstrings of the public standard-library modules (private `_modules`, the test suite, `idlelib`,
  `tkinter`, `turtledemo`, `lib2to3`, `distutils`, `encodings` and modules with import side effects are left
  out): one document per module (module docstring, then its public classes' and functions' docstrings under
  headings); a class with at least {class_page} characters of documentation gets a page of its own. Documents
  shorter than {min_doc} characters and single docstrings shorter than {min_ds} characters are skipped.

The documentation is authored by the Python developers and is distributed under the
**PSF License Agreement for Python {py_minor}** (Python Software Foundation License Version 2,
https://docs.python.org/{py_minor}/license.html). Copyright (c) 2001-2023 Python Software Foundation; All Rights
Reserved. The files here are a derived, reformatted extract of that documentation.

## Files

| file | documents | text bytes | tokens | file bytes |
| --- | ---: | ---: | ---: | ---: |
{table}
| `tokenizer.json` | | | | {tok_bytes} |
| total | {n_docs} | {n_text} | {n_tok} | {n_file} |

Documents by kind: {kinds}. Row groups of {row_group} documents, zstd compression.

* `tokenizer.json`: byte-level BPE (HuggingFace `tokenizers` {tok_version}: ByteLevel pre-tokenizer without prefix
  space, ByteLevel decoder), vocabulary {vocab} including the one special token `{eos}` (id {eos_id}, used as EOS),
  min_frequency 2, trained on the train split only.
* Split: documents sorted by sha256 of their `id`; the first max(3%, {val_min}) go to `val`, the rest to `train`
  (with this corpus size the 50-document floor wins, so val holds ~{val_pct:.0f}% of the documents). Rows are in
  that hash order in both files.

## Schema (FineWeb-Edu's columns)

| column | type | value here |
| --- | --- | --- |
| `text` | string | the document |
| `id` | string | `<urn:pydoc:topic:KEY>`, `<urn:pydoc:module:NAME>` or `<urn:pydoc:class:MODULE.CLASS>` (unique) |
| `dump` | string | `{dump}` |
| `url` | string | `https://docs.python.org/{py_minor}/library/NAME.html` (classes: `#MODULE.CLASS`), topics `https://docs.python.org/{py_minor}/reference/#KEY` (synthetic links) |
| `date` | string | `{date}` for every row (fixed; the 3.11.7 release day) |
| `file_path` | string | the source file inside the Python {py_version} distribution, e.g. `python-{py_version}/Lib/json/decoder.py` |
| `language` | string | `en` |
| `language_score` | float64 | 1.0 |
| `token_count` | int64 | tokens of `text` with `tokenizer.json` (no EOS) |
| `score` | float64 | 3.0: a placeholder (no educational-quality classifier was run) |
| `int_score` | int64 | 3: a placeholder (FineWeb-Edu keeps int_score >= 3) |

## Rebuild

    JAX_PLATFORMS=cpu .venv/bin/python tools/build_embedded_corpus.py   # a few seconds; --out DIR writes elsewhere

The build is deterministic: sorted module order, no timestamps, no memory addresses, a hash split. Re-running it
with the same Python ({py_version}), pyarrow ({pa_version}) and tokenizers ({tok_version}) gives byte-identical
files (checked across PYTHONHASHSEED values, RAYON_NUM_THREADS=1 and working directories). Another Python version
documents other modules and docstrings, so it gives a different corpus and tokenizer; another pyarrow may write
different Parquet bytes for the same rows.

sha256 of this build:

{sha}
"""


def write_readme(out: Path, stats: dict) -> None:
    import hashlib as _h
    import pyarrow
    import tokenizers
    rows, n_docs, n_text, n_tok, n_file = [], 0, 0, 0, 0
    for split in ("train", "val"):
        s = stats[split]
        rows.append(f"| `{split}/part-00000.parquet` | {s['docs']} | {s['bytes']} | {s['tokens']} | {s['file']} |")
        n_docs += s["docs"]
        n_text += s["bytes"]
        n_tok += s["tokens"]
        n_file += s["file"]
    tok_bytes = (out / "tokenizer.json").stat().st_size
    sha = "\n".join(f"    {_h.sha256((out / f).read_bytes()).hexdigest()}  {f}"
                    for f in ("tokenizer.json", "train/part-00000.parquet", "val/part-00000.parquet"))
    text = README_TEMPLATE.format(
        py_version=PY_VERSION, py_minor=PY_MINOR, class_page=CLASS_PAGE_CHARS, min_doc=MIN_DOCUMENT_CHARS,
        min_ds=MIN_DOCSTRING_CHARS, table="\n".join(rows), tok_bytes=tok_bytes, n_docs=n_docs, n_text=n_text,
        n_tok=n_tok, n_file=n_file + tok_bytes, kinds=stats["kinds"], row_group=ROW_GROUP_SIZE,
        tok_version=tokenizers.__version__, vocab=VOCAB_SIZE, eos=EOS_TOKEN, eos_id=stats["eos_id"],
        val_min=VAL_MIN_DOCS, val_pct=100 * stats["val"]["docs"] / n_docs, dump=DUMP, date=DATE,
        pa_version=pyarrow.__version__, sha=sha)
    (out / "README.md").write_text(text, encoding="utf-8")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(DEFAULT_OUT), help="output directory (default: data/embedded)")
    args = ap.parse_args(argv)
    warnings.simplefilter("ignore", DeprecationWarning)  # typing.io & co. warn when their __doc__ is read
    out = Path(args.out)
    t0 = time.time()
    docs = collect_documents()
    train, val = split_documents(docs)
    t1 = time.time()
    tok = train_tokenizer([d["text"] for d in train])
    t2 = time.time()
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    stats = {"eos_id": tok.token_to_id(EOS_TOKEN)}
    for split, ds in (("train", train), ("val", val)):
        counts = [len(e.ids) for e in tok.encode_batch([d["text"] for d in ds], add_special_tokens=False)]
        path = out / split / "part-00000.parquet"
        write_parquet(ds, counts, path)
        nbytes = sum(len(d["text"].encode("utf-8")) for d in ds)
        stats[split] = dict(docs=len(ds), bytes=nbytes, tokens=sum(counts), file=path.stat().st_size)
        print(f"{split}: {len(ds)} docs, {nbytes} bytes of text, {sum(counts)} tokens")
    kinds = {}
    for d in docs:
        kinds[d["kind"]] = kinds.get(d["kind"], 0) + 1
    stats["kinds"] = ", ".join(f"{v} {k} pages" if k != "topic" else f"{v} help topics"
                               for k, v in sorted(kinds.items(), key=lambda kv: kv[0] != "topic"))
    write_readme(out, stats)
    sizes = {str(p.relative_to(out)): p.stat().st_size for p in sorted(out.rglob("*")) if p.is_file()}
    for k, v in sizes.items():
        print(f"  {k}: {v} bytes")
    print(f"python {PY_VERSION}; collect {t1 - t0:.1f}s, tokenizer {t2 - t1:.1f}s, total {time.time() - t0:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
