#!/usr/bin/env python
"""Rebuild a held-out English corpus of technical documentation from Debian packages, split it, train its
BPE and count its tokens, in one command.

One file (about 730 lines) on purpose: it is a script run by its path from a bare checkout (no package to import
helpers from), its tests import it whole (``import build_lm_corpus``), and its sections follow the steps below.

    JAX_PLATFORMS=cpu .venv/bin/python tools/build_lm_corpus.py --cache /work/lmcorpus/cache \\
        --out /work/lmcorpus/corpus [--packages a,b,c] [--device_subset 40000000]

Steps (each prints its progress):
  1. ``apt-get download`` every package of ``--packages`` into ``CACHE/debs`` (kept: a rerun downloads nothing),
     ``dpkg-deb -x`` into ``CACHE/trees/<package>``; the package's archive section and version come from its
     control file.
  2. Licence check: a package from non-free or contrib, or without ``usr/share/doc/<package>/copyright``,
     is refused (skipped, with the reason printed); the ``License:`` short names of the copyright file go to
     the manifest.
  3. Extraction, one document per page: HTML pages (``html.parser``; scripts, styles, navigation, headers
     and footers dropped), man pages (``groff -Tutf8 -man | col -bx``), the GCIDE dictionary (split at entry
     boundaries into documents of ~256 KB). Whitespace is normalised, documents under 200 characters are
     dropped, exact duplicates (sha256 of the whitespace-normalised text) are dropped, first package wins.
     Each package's documents are cached in ``CACHE/extracted``.
  4. JSONL.gz shards in ``OUT/jsonl`` in sha256(id) order (so any prefix is a random sample of all sources),
     then the project's ``training.prepare_data`` (Parquet ``OUT/train``, ``OUT/val``, hash split) and
     ``training.train_tokenizer`` (byte-level BPE, ``OUT/tokenizer.json``, trained on the train split).
  5. Tokens per source with that BPE; ``OUT/manifest.json`` and ``OUT/README.md``.
  6. With ``--device_subset N``: ``OUT/device/`` = the val split plus the first N tokens' worth of train
     documents (sha256 order, a random sample), Parquet zstd, for machines that take little data per call.
"""
from __future__ import annotations

import argparse
import dataclasses
import gzip
import hashlib
import html
import html.parser
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterable, Iterator

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # run as a script from anywhere: the mixerlab packages of this checkout
    sys.path.insert(0, str(REPO_ROOT))

MIN_DOCUMENT_CHARS = 200
MAX_DOCUMENT_CHARS = 256_000     # a longer page (or the dictionary) is split at paragraph / entry boundaries
SHARD_DOCS = 20_000              # documents per JSONL.gz shard
VOCAB_SIZE = 16384
VAL_FRACTION = 0.005
REFUSED_SECTIONS = ("non-free", "contrib")
EXTRACT_VERSION = 3              # bump when an extractor changes: cached extractions are then redone


@dataclasses.dataclass(frozen=True)
class Source:
    package: str
    kind: str                    # html | man | dict
    why: str
    include: str | None = None   # regex on the path inside the package: only matching files
    exclude: str | None = None   # regex on the path inside the package: matching files skipped


# Sphinx builds: reST sources, indexes, search page and the highlighted module sources (code, not docs).
SPHINX_EXCLUDE = r"/_sources/|/_modules/|/genindex|/py-modindex|/search\.html"
# mdBook's print.html repeats a whole book, rustdoc's all.html lists every item, LilyPond's *-big-page.html
# repeats a manual: excluded below so that the same text is not taken twice under another name.

# Prose first; the API references (code-heavy) come last so that dedup keeps the prose copy of a page.
SOURCES = (
    Source("linux-doc-6.1", "html", "the Linux kernel's documentation: long technical prose (GPL-2)",
           exclude=SPHINX_EXCLUDE),
    Source("python3.11-doc", "html", "the Python tutorial, language reference, library reference, HOWTOs (PSF)",
           exclude=SPHINX_EXCLUDE),
    Source("postgresql-doc-15", "html", "the PostgreSQL manual: SQL, administration, internals (PostgreSQL)"),
    Source("perl-doc", "man", "the Perl manual pages (perlfunc, perlop, tutorials) and core modules (Artistic/GPL)",
           include=r"/usr/share/man/"),
    Source("debian-handbook", "html", "The Debian Administrator's Handbook, a book (CC-BY-SA-3.0 / GPL-2+)",
           include=r"/html/en-US/"),
    Source("debian-reference-en", "html", "Debian Reference, a user's and administrator's guide (GPL-2+)"),
    Source("debian-policy", "html", "the Debian Policy Manual (GPL-2+)"),
    Source("developers-reference", "html", "Debian Developer's Reference (GPL-2)"),
    Source("git-doc", "html", "git's manual pages, user manual and how-tos (GPL-2)"),
    Source("manpages", "man", "Linux man pages: files, conventions, overviews (section 4, 5, 7)"),
    Source("manpages-dev", "man", "Linux man pages: system calls and C library functions (sections 2, 3)"),
    Source("libssl-doc", "man", "OpenSSL's library and command man pages (Apache-2.0)", include=r"/usr/share/man/"),
    Source("dict-gcide", "dict", "GCIDE, an English dictionary from Webster's 1913: general vocabulary (GPL)"),
    Source("octave-doc", "html", "the GNU Octave manual (GPL-3+)"),
    Source("maxima-doc", "html", "the Maxima computer-algebra manual (GPL-2)"),
    Source("vim-doc", "html", "Vim's user manual and reference (Vim licence)"),
    Source("zsh-doc", "html", "the Z shell manual (zsh licence, MIT-like)"),
    Source("sphinx-doc", "html", "Sphinx's documentation (BSD-2)", exclude=SPHINX_EXCLUDE),
    Source("bind9-doc", "html", "the BIND 9 administrator reference manual (MPL-2.0)",
           exclude=SPHINX_EXCLUDE),
    Source("llvm-15-doc", "html", "LLVM's documentation: language reference, guides, tutorials (Apache-2.0 + LLVM)",
           exclude=SPHINX_EXCLUDE),
    Source("clang-15-doc", "html", "Clang's user's manual and guides (Apache-2.0 + LLVM exception)",
           exclude=SPHINX_EXCLUDE),
    Source("cmake-doc", "html", "CMake's manual and reference (BSD-3)", exclude=SPHINX_EXCLUDE),
    Source("grass-doc", "html", "the GRASS GIS module manual (GPL-2+)"),
    Source("gimp-help-en", "html", "the GIMP user manual in English (GFDL-1.2+, no invariant sections)"),
    Source("rust-doc", "html", "the Rust books (the book, reference, nomicon, by example) and std API docs",
           exclude=r"/search-index|/src/|/implementors/|/sidebar-items|/print\.html$|/all\.html$"),
    Source("python-sklearn-doc", "html", "scikit-learn's user guide, examples and API reference (BSD-3)",
           exclude=SPHINX_EXCLUDE + r"|/_downloads/"),
    Source("python-scipy-doc", "html", "SciPy's tutorials and API reference (BSD-3)",
           exclude=SPHINX_EXCLUDE),
    Source("python-pandas-doc", "html", "pandas' user guide and API reference (BSD-3)",
           exclude=SPHINX_EXCLUDE),
    Source("python-statsmodels-doc", "html", "statsmodels' user guide, examples and API reference (BSD-3)",
           exclude=SPHINX_EXCLUDE),
    Source("python-astropy-doc", "html", "Astropy's documentation (BSD-3)",
           exclude=SPHINX_EXCLUDE),
    Source("python-sympy-doc", "html", "SymPy's tutorial and reference (BSD-3)",
           exclude=SPHINX_EXCLUDE),
    Source("python-django-doc", "html", "Django's topic guides, howtos and reference (BSD-3)",
           exclude=SPHINX_EXCLUDE),
    Source("twisted-doc", "html", "Twisted's guides and API docs (Expat)",
           exclude=SPHINX_EXCLUDE),
    Source("nodejs-doc", "html", "the Node.js API documentation (Expat)", exclude=r"/all\.html$"),
    Source("erlang-doc", "html", "Erlang/OTP's guides and reference manuals (Apache-2.0)"),
    Source("racket-doc", "html", "Racket's guide and reference (Apache-2.0 / MIT)"),
    Source("lilypond-doc-html", "html", "LilyPond's manuals, English pages only (GFDL-1.3+, no invariant sections)",
           exclude=r"\.(ca|cs|de|es|fr|hu|it|ja|nl|pt|zh|bg|el|ko|pl|ru|tr)\.html$|/input/regression/|-big-page\.html$"),
    Source("cppreference-doc-en-html", "html", "cppreference.com's C and C++ reference (CC-BY-SA-3.0 / GFDL)"),
    Source("sagemath-doc", "html", "SageMath's tutorials and reference manual: mathematics prose and API (GPL)",
           exclude=SPHINX_EXCLUDE + r"|/(de|es|fr|hu|it|ja|pt|ru|tr|ca)/"),
    Source("ghc-doc", "html", "GHC's user's guide and the Haddock API docs of its libraries (BSD-3)",
           exclude=SPHINX_EXCLUDE + r"|/src/|/doc-index"),
    Source("libboost1.81-doc", "html", "the Boost C++ libraries' documentation: design prose and reference (BSL-1.0)"),
    Source("qtbase5-doc-html", "html", "Qt 5's base documentation: overviews and class reference (GFDL-1.3 / BSD)"),
    Source("openjdk-17-doc", "html", "the Java 17 API documentation: low prose quality, a last resort (GPL+CE)",
           exclude=r"/index-files/|/class-use/|-tree\.html$|/allclasses|/package-use"),
)
SOURCES_BY_NAME = {s.package: s for s in SOURCES}


class Refused(Exception):
    """A package this corpus may not take; the message says why."""


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ------------------------------------------------------------------------------------------ text cleaning
_SPACES = re.compile(r"[ \t\f\v\r\u00a0]+")
_BLANKS = re.compile(r"\n\s*\n\s*(\n\s*)+")


def normalise_whitespace(text: str) -> str:
    """Runs of spaces become one space, lines are stripped, more than one blank line becomes one."""
    lines = [_SPACES.sub(" ", line).strip() for line in text.split("\n")]
    return _BLANKS.sub("\n\n", "\n".join(lines)).strip()


def dedup_key(text: str) -> str:
    return hashlib.sha256(" ".join(text.split()).encode("utf-8")).hexdigest()


def split_long(text: str, limit: int = MAX_DOCUMENT_CHARS) -> list[str]:
    """Pieces of at most ~``limit`` characters, cut at blank lines (a paragraph longer than the limit stays whole)."""
    if len(text) <= limit:
        return [text]
    pieces, current, size = [], [], 0
    for para in text.split("\n\n"):
        if current and size + len(para) > limit:
            pieces.append("\n\n".join(current))
            current, size = [], 0
        current.append(para)
        size += len(para) + 2
    if current:
        pieces.append("\n\n".join(current))
    return pieces


# ------------------------------------------------------------------------------------------ HTML
_SKIP_TAGS = {"script", "style", "nav", "header", "footer", "noscript", "svg", "form", "button", "head",
              "template", "iframe", "select", "math"}
_VOID_TAGS = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "param", "source",
              "track", "wbr", "keygen"}
_BLOCK_TAGS = {"p", "div", "section", "article", "main", "aside", "li", "ul", "ol", "dl", "dt", "dd", "table",
               "tr", "thead", "tbody", "blockquote", "pre", "h1", "h2", "h3", "h4", "h5", "h6", "figure",
               "figcaption", "caption", "details", "summary", "hr", "br", "center", "address"}
# Navigation boilerplate, matched against whole class/id/role tokens (not "header": Qt's pages open a
# <div class="header"> that is never closed before the content): Sphinx sidebars and "related" bars, the
# Read-the-Docs theme's side menu, DocBook's navheader/navfooter/docnav, javadoc's bars, permalink anchors,
# rustdoc's sidebar and its trait-implementation lists (the trait's docs repeated on every type's page).
_BOILERPLATE_TOKENS = frozenset("""
    sidebar sphinxsidebar sphinxsidebarwrapper related breadcrumbs wy-breadcrumbs wy-nav-side wy-side-scroll
    wy-side-nav-search wy-menu rst-footer-buttons rst-versions navbar navigationbar navheader
    navfooter docnav nav navigation
    search searchbox footer headerlink skip-nav top-nav sub-nav bottom-nav fixed-nav legalnotice
    sidebar-elems srclink anchor since notable-traits trait-impl trait-implementations-list
    synthetic-implementations-list blanket-implementations-list implementors-list toc-backref menu
    """.split())


def _is_boilerplate(attrs: dict) -> bool:
    tokens = f"{attrs.get('class') or ''} {attrs.get('id') or ''} {attrs.get('role') or ''}".lower().split()
    return any(t in _BOILERPLATE_TOKENS for t in tokens) or attrs.get("aria-hidden") == "true"


_PRE_SPACE = "\ue000"  # a private-use character standing for a space inside <pre> until normalisation is done


class _TextExtractor(html.parser.HTMLParser):
    """Visible text of a page with paragraph breaks; skipped subtrees are tracked on a tag stack so that a
    missing end tag cannot swallow the rest of the page."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.parts: list[str] = []
        self.stack: list[tuple[str, bool]] = []  # (tag, this element starts a skipped subtree)
        self.skipping = 0
        self.pre = 0
        self.title: list[str] = []
        self.in_title = False

    def handle_starttag(self, tag, attrs):
        if tag == "title":
            self.in_title = True
        if tag in _VOID_TAGS:
            if tag in ("br", "hr") and not self.skipping:
                self.parts.append("\n")
            return
        skip = tag in _SKIP_TAGS or _is_boilerplate(dict(attrs))
        self.stack.append((tag, skip))
        self.skipping += skip
        if tag == "pre":
            self.pre += 1
        if tag in _BLOCK_TAGS and not self.skipping:
            self.parts.append("\n\n" if tag not in ("li", "dd", "tr") else "\n")
        elif tag in ("td", "th") and not self.skipping:
            self.parts.append(" ")

    def handle_startendtag(self, tag, attrs):
        if tag in ("br", "hr") and not self.skipping:
            self.parts.append("\n")

    def handle_endtag(self, tag):
        if tag == "title":
            self.in_title = False
        if tag in _VOID_TAGS or not any(t == tag for t, _ in self.stack):
            return  # a stray end tag
        while self.stack:
            open_tag, skip = self.stack.pop()
            self.skipping -= skip
            if open_tag == "pre":
                self.pre -= 1
            if open_tag == tag:
                break
        if tag in _BLOCK_TAGS and not self.skipping:
            self.parts.append("\n\n")

    def handle_data(self, data):
        if self.in_title:
            self.title.append(data)
        if self.skipping:
            return
        if self.pre:
            self.parts.append(data.replace("\t", "    ").replace(" ", _PRE_SPACE))  # survives normalisation
        else:
            self.parts.append(data.replace("\n", " "))


def html_to_text(markup: str) -> str:
    """The readable text of an HTML page: paragraphs on their own lines, code blocks with their indentation."""
    parser = _TextExtractor()
    parser.feed(markup)
    parser.close()
    text = normalise_whitespace("".join(parser.parts))
    return text.replace(_PRE_SPACE, " ")


# ------------------------------------------------------------------------------------------ man pages
def man_to_text(path: Path) -> str:
    """A man page rendered by groff (no hyphenation, wide lines), overstrikes removed by ``col -bx``; "" for a
    ``.so`` link."""
    raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    if raw.lstrip().startswith(b".so "):
        return ""  # an alias of another page, which is extracted on its own
    env = dict(os.environ, GROFF_NO_SGR="1", MANWIDTH="80", LC_ALL="C.UTF-8")
    groff = subprocess.run(["groff", "-Tutf8", "-man", "-P-c", "-rLL=160n", "-rHY=0", "-t"], input=raw,
                           capture_output=True, env=env, timeout=60)
    col = subprocess.run(["col", "-bx"], input=groff.stdout, capture_output=True, env=env, timeout=60)
    return normalise_whitespace(col.stdout.decode("utf-8", "replace"))


# ------------------------------------------------------------------------------------------ dictd dictionaries
_B64 = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"


def dictd_number(field: str) -> int:
    """dictd's index numbers: base 64, most significant digit first, alphabet A-Z a-z 0-9 + /."""
    value = 0
    for ch in field:
        value = value * 64 + _B64.index(ch)
    return value


def dictd_entries(index_text: str, data: bytes) -> list[str]:
    """Every entry of a dictd dictionary once (headwords sharing an entry point at the same bytes), in file
    order, without the ``00-database-*`` metadata entries."""
    spans = {}
    for line in index_text.splitlines():
        fields = line.split("\t")
        if len(fields) < 3 or fields[0].startswith("00-database") or fields[0].startswith("00database"):
            continue
        spans[dictd_number(fields[1])] = dictd_number(fields[2])
    return [data[start:start + length].decode("utf-8", "replace") for start, length in sorted(spans.items())]


def group_entries(entries: Iterable[str], limit: int = MAX_DOCUMENT_CHARS) -> list[str]:
    """Consecutive entries joined into documents of at most ~``limit`` characters, never cutting an entry."""
    docs, current, size = [], [], 0
    for entry in entries:
        entry = normalise_whitespace(entry)
        if not entry:
            continue
        if current and size + len(entry) > limit:
            docs.append("\n\n".join(current))
            current, size = [], 0
        current.append(entry)
        size += len(entry) + 2
    if current:
        docs.append("\n\n".join(current))
    return docs


# ------------------------------------------------------------------------------------------ packages
def control_field(deb: Path, field: str) -> str:
    return subprocess.run(["dpkg-deb", "-f", str(deb), field], capture_output=True, text=True,
                          check=True).stdout.strip()


def download(package: str, cache: Path) -> Path:
    """The package's .deb in ``cache/debs`` (downloaded by ``apt-get download`` unless already there)."""
    debs = cache / "debs"
    debs.mkdir(parents=True, exist_ok=True)
    found = sorted(debs.glob(f"{package}_*.deb"))
    if not found:
        run = subprocess.run(["apt-get", "download", package], cwd=debs, capture_output=True, text=True)
        found = sorted(debs.glob(f"{package}_*.deb"))
        if run.returncode != 0 or not found:
            raise Refused(f"apt-get download {package} failed: {run.stderr.strip()[-300:]}")
    return found[-1]


def unpack(deb: Path, tree: Path) -> Path:
    if not tree.is_dir():
        tmp = tree.with_name(tree.name + ".partial")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.parent.mkdir(parents=True, exist_ok=True)  # dpkg-deb -x makes the folder, not its parents
        subprocess.run(["dpkg-deb", "-x", str(deb), str(tmp)], check=True)
        tmp.rename(tree)
    return tree


def copyright_file(tree: Path, package: str, cache: Path | None = None) -> Path:
    """``usr/share/doc/<package>/copyright``; when that folder is a symlink to a sibling package's folder (as
    Debian allows for a package that depends on its sibling), the sibling's copyright file."""
    doc = tree / "usr" / "share" / "doc" / package
    if doc.is_symlink() and cache is not None:
        sibling = os.readlink(doc).strip("/").split("/")[-1]
        if sibling and sibling != package:
            sibling_tree = unpack(download(sibling, cache), cache / "trees" / sibling)
            return copyright_file(sibling_tree, sibling)
    path = doc / "copyright"
    if not path.is_file():
        raise Refused(f"{package}: no usr/share/doc/{package}/copyright in the package; its licence cannot be "
                      f"checked")
    return path


def licence_names(copyright_text: str) -> list[str]:
    """The short names of the ``License:`` fields of a machine-readable copyright file (sorted, unique); for a
    free-form file, ["unstructured"] (the manifest then keeps its first lines for a reader)."""
    names = {m.group(1).strip() for m in re.finditer(r"^License:[ \t]*(\S[^\n]*)$", copyright_text, re.MULTILINE)}
    names = {n for n in names if len(n) <= 80}
    return sorted(names) or ["unstructured"]


def check_licence(tree: Path, package: str, section: str, cache: Path | None = None) -> dict:
    """{"section", "licences", "copyright_head"}; Refused for a non-free or contrib package or a missing
    copyright file."""
    area = section.split("/")[0] if "/" in section else "main"
    if area in REFUSED_SECTIONS:
        raise Refused(f"{package}: archive section {section!r} is {area}, not Debian main (not DFSG-free)")
    text = copyright_file(tree, package, cache).read_text("utf-8", "replace")
    head = " ".join(text.split()[:60])
    return {"section": section, "licences": licence_names(text), "copyright_head": head}


# ------------------------------------------------------------------------------------------ extraction
def _files(tree: Path, suffixes: tuple[str, ...], source: Source) -> Iterator[Path]:
    include = re.compile(source.include) if source.include else None
    exclude = re.compile(source.exclude) if source.exclude else None
    for folder, dirs, names in os.walk(tree):
        dirs.sort()
        for name in sorted(names):
            path = Path(folder) / name
            rel = "/" + str(path.relative_to(tree))
            if not name.endswith(suffixes) or path.is_symlink():
                continue
            if (include and not include.search(rel)) or (exclude and exclude.search(rel)):
                continue
            yield path


def _page_text(job: tuple[str, str]) -> str:
    kind, path = job
    if kind == "html":
        return html_to_text(Path(path).read_bytes().decode("utf-8", "replace"))
    return man_to_text(Path(path))


def extract_documents(source: Source, tree: Path, workers: int = 1) -> Iterator[tuple[str, str]]:
    """(id, text) of every document of one unpacked package, before length filtering and dedup; pages are
    converted by ``workers`` processes (in file order)."""
    if source.kind in ("html", "man"):
        suffixes = (".html", ".htm", ".xhtml") if source.kind == "html" else \
            (".gz",) + tuple(f".{n}" for n in "123456789")
        paths = list(_files(tree, suffixes, source))
        jobs = [(source.kind, str(p)) for p in paths]
        if workers > 1:
            import multiprocessing

            pool = multiprocessing.get_context("fork").Pool(workers)
            texts = pool.imap(_page_text, jobs, chunksize=8)
        else:
            pool, texts = None, map(_page_text, jobs)
        for n, (path, text) in enumerate(zip(paths, texts), 1):
            if n % 2000 == 0:
                log(f"  {source.package}: {n}/{len(paths)} pages")
            rel = path.relative_to(tree)
            for i, piece in enumerate(split_long(text)):
                yield f"{source.package}:{rel}" + (f"#{i}" if i else ""), piece
        if pool is not None:
            pool.close()
            pool.join()
    elif source.kind == "dict":
        for index in sorted(tree.glob("usr/share/dictd/*.index")):
            data_path = index.with_suffix(".dict.dz")
            data = gzip.decompress(data_path.read_bytes())  # dictzip is gzip with a seek table
            docs = group_entries(dictd_entries(index.read_text("utf-8", "replace"), data), MAX_DOCUMENT_CHARS)
            for i, text in enumerate(docs):
                yield f"{source.package}:{index.stem}#{i}", text
    else:
        raise ValueError(f"Source.kind: {source.kind!r} for {source.package} is not one of html, man, dict")


def keep_documents(docs: Iterable[tuple[str, str]], seen: set[str], stats: dict) -> Iterator[tuple[str, str]]:
    """Drops documents under MIN_DOCUMENT_CHARS and exact duplicates of any document seen before (``seen``
    holds dedup keys across packages); counts what it drops in ``stats``."""
    for doc_id, text in docs:
        if len(text) < MIN_DOCUMENT_CHARS:
            stats["dropped_short"] = stats.get("dropped_short", 0) + 1
            continue
        key = dedup_key(text)
        if key in seen:
            stats["dropped_duplicate"] = stats.get("dropped_duplicate", 0) + 1
            continue
        seen.add(key)
        yield doc_id, text


def extracted_path(cache: Path, source: Source, version: str) -> Path:
    """The cache file of one package's extraction: named by version, extractor version and file filters."""
    safe = re.sub(r"[^A-Za-z0-9.+-]", "_", version)
    filters = hashlib.sha256(f"{source.kind}|{source.include}|{source.exclude}".encode()).hexdigest()[:8]
    return cache / "extracted" / f"{source.package}_{safe}_x{EXTRACT_VERSION}_{filters}.jsonl.gz"


def extract_cached(source: Source, tree: Path, dest: Path, workers: int = 1) -> Path:
    """The package's raw documents as JSONL.gz (extracted once; reused while EXTRACT_VERSION is unchanged)."""
    if dest.exists():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(dest.name + ".partial")
    count = 0
    with gzip.open(tmp, "wt", encoding="utf-8", compresslevel=1) as f:
        for doc_id, text in extract_documents(source, tree, workers):
            f.write(json.dumps({"id": doc_id, "text": text}, ensure_ascii=False) + "\n")
            count += 1
    log(f"  {source.package}: {count} documents extracted")
    tmp.rename(dest)
    return dest


def read_jsonl(path: Path) -> Iterator[tuple[str, str]]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for line in f:
            row = json.loads(line)
            yield row["id"], row["text"]


def hash_order(doc_id: str) -> str:
    return hashlib.sha256(doc_id.encode("utf-8")).hexdigest()


def write_shards(docs: list[tuple[str, str, str]], out: Path, shard_docs: int = SHARD_DOCS) -> list[str]:
    """JSONL.gz shards of {"id", "text", "source"} in sha256(id) order; returns their file names."""
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("part-*.jsonl.gz"):
        old.unlink()
    ordered = sorted(docs, key=lambda d: hash_order(d[0]))
    names = []
    for lo in range(0, len(ordered), shard_docs):
        name = f"part-{lo // shard_docs:05d}.jsonl.gz"
        with gzip.open(out / name, "wt", encoding="utf-8", compresslevel=6) as f:
            for doc_id, text, source in ordered[lo:lo + shard_docs]:
                f.write(json.dumps({"id": doc_id, "text": text, "source": source}, ensure_ascii=False) + "\n")
        names.append(name)
    return names


# ------------------------------------------------------------------------------------------ tokens
def source_of(doc_id: str) -> str:
    return doc_id.split(":", 1)[0]


def count_tokens(parquet_dir: Path, tokenizer_path: Path, lengths: dict | None = None) -> dict[str, dict]:
    """{source: {"docs", "bytes", "tokens"}} of one split (tokens without EOS), from its Parquet shards; with
    ``lengths``, also each document's token count by id (the device subset reuses them)."""
    import pyarrow.parquet as pq
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_path))
    counts: dict[str, dict] = {}
    for path in sorted(parquet_dir.glob("*.parquet")):
        pf = pq.ParquetFile(path)
        for rg in range(pf.num_row_groups):
            table = pf.read_row_group(rg, columns=["text", "id"])
            texts, ids = table.column(0).to_pylist(), table.column(1).to_pylist()
            for doc_id, text, enc in zip(ids, texts, tok.encode_batch(texts)):
                c = counts.setdefault(source_of(doc_id), {"docs": 0, "bytes": 0, "tokens": 0})
                c["docs"] += 1
                c["bytes"] += len(text.encode("utf-8"))
                c["tokens"] += len(enc.ids)
                if lengths is not None:
                    lengths[doc_id] = len(enc.ids)
        log(f"  counted {path.parent.name}/{path.name}")
    return counts


def select_subset(rows: Iterable[tuple[str, str, int]], budget: int) -> list[tuple[str, str]]:
    """(id, text) of the documents taken in sha256(id) order while they fit in ``budget`` tokens (each row's
    count, EOS included); a document that does not fit is passed over, so the budget is filled closely."""
    chosen, total = [], 0
    for doc_id, text, n in sorted(rows, key=lambda r: hash_order(r[0])):
        if total + n <= budget:
            chosen.append((doc_id, text))
            total += n
    return chosen


def write_parquet(docs: list[tuple[str, str]], path: Path, row_group_docs: int = 1000) -> None:
    from mixerlab.training.prepare_data import write_documents

    path.parent.mkdir(parents=True, exist_ok=True)
    write_documents(str(path), [t for _, t in docs], [i for i, _ in docs], row_group_docs)


def write_device_subset(out: Path, tokenizer_path: Path, budget: int, known: dict | None = None,
                        parts: int = 1) -> dict:
    """OUT/device/{train,val,tokenizer.json}: the whole val split plus a hash-ordered sample of train of at
    most ``budget`` tokens (EOS counted, as the trainer packs them). ``known``: token counts by id (no EOS)
    already measured with this tokenizer; documents not in it are encoded here. ``parts`` > 1: as many more
    disjoint samples of ``budget`` tokens each, the next documents in hash order, as
    OUT/device_parts/part-0000k.parquet (k = 1, 2, ...): each fits one transfer to a machine that receives
    little per call, where it joins OUT/device/train/ before training starts."""
    import pyarrow.parquet as pq
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_path))
    known = known or {}
    rows = []
    for path in sorted((out / "train").glob("*.parquet")):
        table = pq.read_table(path, columns=["text", "id"])
        texts, ids = table.column(0).to_pylist(), table.column(1).to_pylist()
        missing = [i for i, doc_id in enumerate(ids) if doc_id not in known]
        for lo in range(0, len(missing), 4096):
            batch = missing[lo:lo + 4096]
            for i, enc in zip(batch, tok.encode_batch([texts[i] for i in batch])):
                known[ids[i]] = len(enc.ids)
        rows += [(doc_id, text, known[doc_id] + 1) for doc_id, text in zip(ids, texts)]
    lengths = {doc_id: n for doc_id, _, n in rows}
    chosen = select_subset(rows, budget)
    device = out / "device"
    shutil.rmtree(device, ignore_errors=True)
    shutil.rmtree(out / "device_parts", ignore_errors=True)
    write_parquet(chosen, device / "train" / "part-00000.parquet")
    taken, more = {i for i, _ in chosen}, []
    for k in range(1, parts):
        part = select_subset([r for r in rows if r[0] not in taken], budget)
        taken |= {i for i, _ in part}
        write_parquet(part, out / "device_parts" / f"part-{k:05d}.parquet")
        more.append({"file": f"device_parts/part-{k:05d}.parquet", "train_docs": len(part),
                     "train_tokens_with_eos": sum(lengths[i] for i, _ in part)})
    shutil.copytree(out / "val", device / "val")
    shutil.copy(tokenizer_path, device / "tokenizer.json")  # the subset travels alone (configs/lm_compare read it)
    train_tokens = sum(lengths[i] for i, _ in chosen)
    train_bytes = (device / "train" / "part-00000.parquet").stat().st_size
    val_bytes = sum(p.stat().st_size for p in (device / "val").glob("*.parquet"))
    info = {"budget_tokens": budget, "train_docs": len(chosen), "train_tokens_with_eos": train_tokens,
            "train_parquet_bytes": train_bytes, "val_parquet_bytes": val_bytes,
            "parquet_bytes_per_train_token": round(train_bytes / max(train_tokens, 1), 4),
            "sources": sorted({source_of(i) for i, _ in chosen})}
    if more:
        info["more_parts"] = more
    (device / "manifest.json").write_text(json.dumps(info, indent=1))
    return info


# ------------------------------------------------------------------------------------------ main
def build(packages: list[str], cache: Path, out: Path, *, vocab_size: int, val_fraction: float,
          tokenizer_docs: int | None, device_subset: int | None, workers: int, command: str,
          device_parts: int = 1) -> dict:
    from mixerlab.training import prepare_data, train_tokenizer

    start = time.time()
    seen: set[str] = set()
    docs: list[tuple[str, str, str]] = []
    manifest_packages = []
    for name in packages:
        source = SOURCES_BY_NAME.get(name) or Source(name, "html", "given on the command line")
        try:
            deb = download(name, cache)
            version, section = control_field(deb, "Version"), control_field(deb, "Section")
            log(f"{name} {version} ({section}): {deb.name}")
            tree = unpack(deb, cache / "trees" / name)
            licence = check_licence(tree, name, section, cache)
        except Refused as e:
            log(f"REFUSED {e}")
            manifest_packages.append({"package": name, "refused": str(e)})
            continue
        raw = extract_cached(source, tree, extracted_path(cache, source, version), workers)
        stats: dict = {}
        kept = list(keep_documents(read_jsonl(raw), seen, stats))
        docs += [(doc_id, text, name) for doc_id, text in kept]
        chars = sum(len(t) for _, t in kept)
        log(f"  {name}: {len(kept)} documents, {chars:,} characters kept ({stats})")
        manifest_packages.append({"package": name, "version": version, "deb": deb.name, "kind": source.kind,
                                  "why": source.why, **licence, "documents": len(kept), "characters": chars,
                                  **stats})
    log(f"writing {len(docs)} documents as JSONL.gz shards")
    shards = write_shards(docs, out / "jsonl")
    del docs, seen
    log("training.prepare_data: Parquet train/val")
    for split in ("train", "val"):
        shutil.rmtree(out / split, ignore_errors=True)
    if prepare_data.main(["--source", str(out / "jsonl"), "--out", str(out), "--val_fraction", str(val_fraction),
                          "--overwrite", "--no_progress"]) != 0:
        raise SystemExit("training.prepare_data failed (its message is above)")
    log(f"training.train_tokenizer: byte-level BPE, vocabulary {vocab_size}")
    tok_path = out / "tokenizer.json"
    info = train_tokenizer.train(str(out / "train"), vocab_size, str(tok_path), max_docs=tokenizer_docs,
                                 show_progress=False)
    log("counting tokens per source")
    train_lengths: dict[str, int] = {}
    per_split = {"train": count_tokens(out / "train", tok_path, train_lengths),
                 "val": count_tokens(out / "val", tok_path)}
    manifest = {
        "command": command, "built": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "wall_seconds": None, "tokenizer": {"path": "tokenizer.json", **info, "trained_on_docs": info["docs"]},
        "jsonl_shards": shards, "val_fraction": val_fraction, "packages": manifest_packages,
        "splits": {split: {"docs": sum(c["docs"] for c in counts.values()),
                           "bytes": sum(c["bytes"] for c in counts.values()),
                           "tokens": sum(c["tokens"] for c in counts.values()), "by_source": counts}
                   for split, counts in per_split.items()},
    }
    if device_subset:
        log(f"device subset: {device_subset:,} train tokens")
        manifest["device_subset"] = write_device_subset(out, tok_path, device_subset, train_lengths, device_parts)
    manifest["wall_seconds"] = round(time.time() - start)
    # One manifest: training.prepare_data's (shards, split rule, checksums) gains this build's "corpus" record.
    split_manifest = json.loads((out / prepare_data.MANIFEST).read_text())
    split_manifest["corpus"] = manifest
    (out / prepare_data.MANIFEST).write_text(json.dumps(split_manifest, indent=1))
    (out / "README.md").write_text(readme(manifest))
    return manifest


def readme(m: dict) -> str:
    train, val = m["splits"]["train"], m["splits"]["val"]
    lines = ["# Debian documentation corpus", "",
             "Technical English from the documentation packages of Debian main, extracted, deduplicated and split",
             "by `tools/build_lm_corpus.py` (mixerlab). Rebuild:", "", f"    {m['command']}", "",
             f"Built {m['built']} in {m['wall_seconds']} s. Tokenizer: byte-level BPE, vocabulary "
             f"{m['tokenizer']['vocab_size']}, trained on {m['tokenizer']['trained_on_docs']} train documents.", "",
             "| split | documents | bytes | tokens (no EOS) |", "| --- | ---: | ---: | ---: |",
             f"| train | {train['docs']:,} | {train['bytes']:,} | {train['tokens']:,} |",
             f"| val | {val['docs']:,} | {val['bytes']:,} | {val['tokens']:,} |", "",
             "| package | version | licences (copyright file) | documents | train tokens | share |",
             "| --- | --- | --- | ---: | ---: | ---: |"]
    for p in m["packages"]:
        if "refused" in p:
            lines.append(f"| {p['package']} | refused: {p['refused']} | | | | |")
            continue
        tokens = train["by_source"].get(p["package"], {}).get("tokens", 0)
        licences = ", ".join(p["licences"])
        lines.append(f"| {p['package']} | {p['version']} | {licences[:160]} | {p['documents']:,} | {tokens:,} | "
                     f"{100 * tokens / max(train['tokens'], 1):.1f} % |")
    if "device_subset" in m:
        d = m["device_subset"]
        lines += ["", f"`device/`: val plus {d['train_docs']:,} train documents, {d['train_tokens_with_eos']:,} "
                      f"tokens with EOS, {d['train_parquet_bytes']:,} bytes of Parquet (zstd), "
                      f"{d['parquet_bytes_per_train_token']} bytes per token."]
    lines += ["", "Full details (licence heads, dropped counts, per-source bytes): `manifest.json`, key `corpus`.", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--packages", default=",".join(s.package for s in SOURCES),
                    help="comma-separated Debian packages (default: the SOURCES list, prose first)")
    ap.add_argument("--cache", required=True, help="downloaded .deb files, unpacked trees, extracted pages")
    ap.add_argument("--out", required=True, help="output directory (jsonl/, train/, val/, tokenizer.json, ...)")
    ap.add_argument("--vocab_size", type=int, default=VOCAB_SIZE)
    ap.add_argument("--val_fraction", type=float, default=VAL_FRACTION)
    ap.add_argument("--tokenizer_docs", type=int, default=None,
                    help="train the BPE on the first N train documents (a random sample: rows are hash-ordered)")
    ap.add_argument("--device_subset", type=int, default=None, metavar="TOKENS",
                    help="also write OUT/device/: val + this many train tokens (EOS included)")
    ap.add_argument("--device_parts", type=int, default=1, metavar="K",
                    help="with --device_subset: K disjoint samples of that many tokens, the first in OUT/device/, "
                         "the others as OUT/device_parts/part-0000k.parquet (one transfer each)")
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="processes converting pages")
    args = ap.parse_args(argv)
    if args.device_parts < 1 or (args.device_parts > 1 and not args.device_subset):
        ap.error(f"--device_parts: a count >= 1 that needs --device_subset, got {args.device_parts}")
    packages = [p.strip() for p in args.packages.split(",") if p.strip()]
    command = "python tools/build_lm_corpus.py " + " ".join(argv if argv is not None else sys.argv[1:])
    m = build(packages, Path(args.cache).resolve(), Path(args.out).resolve(), vocab_size=args.vocab_size,
              val_fraction=args.val_fraction, tokenizer_docs=args.tokenizer_docs, device_subset=args.device_subset,
              workers=args.workers, command=command, device_parts=args.device_parts)
    log(f"done in {m['wall_seconds']} s: train {m['splits']['train']['tokens']:,} tokens, "
        f"val {m['splits']['val']['tokens']:,} tokens; {Path(args.out) / 'README.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
