"""tools/build_lm_corpus.py on tiny synthetic packages in tmp dirs: HTML/man/dictionary extraction, splitting,
dedup, the licence check and the device subset's token budget. No network, no apt."""
from __future__ import annotations

import gzip
import json
import os
import shutil
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO_ROOT, "tools"))
try:
    import build_lm_corpus as blc
finally:
    sys.path.pop(0)

PARAGRAPH = "The kernel schedules threads by priority; a runnable thread waits in its queue until chosen. " * 3


# ----------------------------------------------------------------------------------------------- HTML
def test_html_to_text_drops_scripts_styles_and_navigation_and_keeps_paragraphs():
    page = """<html><head><title>T</title><style>p { color: red }</style></head><body>
      <div class="sphinxsidebar"><ul><li>Navigation entry</li></ul></div>
      <nav>Previous | Next</nav>
      <script>var tracking = 1;</script>
      <div class="body"><h1>Scheduling<a class="headerlink" href="#s">¶</a></h1>
      <p>First   paragraph,
      on two lines.</p><p>Second &amp; last paragraph.</p>
      <pre>def f():
    return 1</pre></div>
      <div class="footer">Copyright footer</div></body></html>"""
    text = blc.html_to_text(page)
    assert text == ("Scheduling\n\nFirst paragraph, on two lines.\n\nSecond & last paragraph.\n\n"
                    "def f():\n    return 1")


def test_html_to_text_an_unclosed_tag_does_not_swallow_the_page():
    text = blc.html_to_text("<div class='wy-nav-content'><p>kept<div class='related'>nav<p>also nav</div>"
                            "<p>after the bar</p></div>")
    assert "kept" in text and "after the bar" in text
    assert "nav" not in text.replace("after", "")


def test_split_long_cuts_at_paragraphs_and_loses_nothing():
    paras = [f"paragraph {i} " + "x" * 40 for i in range(50)]
    text = "\n\n".join(paras)
    pieces = blc.split_long(text, limit=300)
    assert len(pieces) > 1
    assert all(len(p) <= 300 for p in pieces)
    assert "\n\n".join(pieces) == text
    assert blc.split_long("short", limit=300) == ["short"]


# ----------------------------------------------------------------------------------------------- dictd
def _b64(n: int) -> str:
    alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"
    digits = ""
    while True:
        digits = alphabet[n % 64] + digits
        n //= 64
        if n == 0:
            return digits


def _fake_dictionary(tree, entries: dict[str, str]):
    folder = tree / "usr" / "share" / "dictd"
    folder.mkdir(parents=True)
    data, index = b"", []
    header = b"00-database-info\nThis file was converted by dictfmt.\n"
    index.append(f"00-database-info\t{_b64(0)}\t{_b64(len(header))}")
    data += header
    for word, body in entries.items():
        raw = f"{word}\n   {body}\n".encode()
        index.append(f"{word}\t{_b64(len(data))}\t{_b64(len(raw))}")
        if word == "colour":  # a second headword pointing at the same entry
            index.append(f"color\t{_b64(len(data))}\t{_b64(len(raw))}")
        data += raw
    (folder / "tiny.index").write_text("\n".join(sorted(index)) + "\n")
    (folder / "tiny.dict.dz").write_bytes(gzip.compress(data))


def test_dictd_numbers_are_base64_most_significant_first():
    assert [blc.dictd_number(s) for s in ("A", "B", "/", "BA", "BAA")] == [0, 1, 63, 64, 4096]
    assert all(blc.dictd_number(_b64(n)) == n for n in (0, 5, 64, 1000, 123456))


def test_dictionary_is_split_into_documents_at_entry_boundaries(tmp_path, monkeypatch):
    entries = {f"word{i:02d}": f"definition {i}: " + "meaning " * 12 for i in range(20)}
    entries["colour"] = "a hue; " + "shade " * 10
    _fake_dictionary(tmp_path, entries)
    source = blc.Source("tiny-dict", "dict", "test")
    monkeypatch.setattr(blc, "MAX_DOCUMENT_CHARS", 600)
    docs = list(blc.extract_documents(source, tmp_path))
    texts = [t for _, t in docs]
    joined = "\n\n".join(texts)
    assert len(texts) > 1
    assert "00-database" not in joined and "dictfmt" not in joined
    assert joined.count("a hue;") == 1  # two headwords, one entry, taken once
    for word, body in entries.items():  # every entry whole, inside exactly one document
        whole = f"{word}\n{body.strip()}"
        assert sum(whole in t for t in texts) == 1, word


def test_group_entries_respects_the_limit_but_never_cuts_an_entry():
    entries = ["a" * 100, "b" * 100, "c" * 500, "d" * 50]
    docs = blc.group_entries(entries, limit=250)
    assert docs == ["a" * 100 + "\n\n" + "b" * 100, "c" * 500, "d" * 50]


# ----------------------------------------------------------------------------------------------- dedup
def test_keep_documents_drops_short_texts_and_whitespace_duplicates_across_packages():
    seen: set[str] = set()
    stats: dict = {}
    first = list(blc.keep_documents([("a:1", PARAGRAPH), ("a:2", "too short"),
                                     ("a:3", PARAGRAPH.replace(" ", "  \n "))], seen, stats))
    assert [i for i, _ in first] == ["a:1"]
    assert stats == {"dropped_short": 1, "dropped_duplicate": 1}
    second = list(blc.keep_documents([("b:1", PARAGRAPH), ("b:2", PARAGRAPH + " More.")], seen, {}))
    assert [i for i, _ in second] == ["b:2"]  # the first package's copy wins


def test_write_shards_orders_documents_by_hash_of_id(tmp_path):
    docs = [(f"pkg{i % 3}:page{i}", f"text {i}", f"pkg{i % 3}") for i in range(30)]
    names = blc.write_shards(docs, tmp_path, shard_docs=7)
    assert names == [f"part-{i:05d}.jsonl.gz" for i in range(5)]
    rows = [json.loads(line) for n in names for line in gzip.open(tmp_path / n, "rt")]
    assert sorted(r["id"] for r in rows) == sorted(d[0] for d in docs)
    assert [r["id"] for r in rows] == sorted((r["id"] for r in rows), key=blc.hash_order)
    assert {r["source"] for r in rows[:10]} == {"pkg0", "pkg1", "pkg2"}


# ----------------------------------------------------------------------------------------------- licences
def _fake_package(tmp_path, name: str, copyright_text: str | None):
    tree = tmp_path / name
    (tree / "usr" / "share" / "doc" / name).mkdir(parents=True)
    if copyright_text is not None:
        (tree / "usr" / "share" / "doc" / name / "copyright").write_text(copyright_text)
    return tree


DEP5 = """Format: https://www.debian.org/doc/packaging-manuals/copyright-format/1.0/
Files: *
Copyright: 2020 Someone
License: GPL-2+
 This program is free software; License: not a field when indented

Files: doc/*
License: CC-BY-SA-3.0 or GFDL-NIV
"""


def test_licence_check_reads_the_license_fields(tmp_path):
    info = blc.check_licence(_fake_package(tmp_path, "ok-doc", DEP5), "ok-doc", "doc")
    assert info["licences"] == ["CC-BY-SA-3.0 or GFDL-NIV", "GPL-2+"]
    assert info["section"] == "doc"


@pytest.mark.parametrize("section", ["non-free/doc", "contrib/text", "non-free/utils"])
def test_licence_check_refuses_non_free_and_contrib(tmp_path, section):
    tree = _fake_package(tmp_path, "bad-doc", DEP5)
    with pytest.raises(blc.Refused, match=r"bad-doc: archive section .*not Debian main"):
        blc.check_licence(tree, "bad-doc", section)


def test_licence_check_refuses_a_package_without_copyright(tmp_path):
    tree = _fake_package(tmp_path, "bare-doc", None)
    with pytest.raises(blc.Refused, match=r"bare-doc: no usr/share/doc/bare-doc/copyright"):
        blc.check_licence(tree, "bare-doc", "doc")


def test_licence_names_of_a_free_form_copyright_file():
    assert blc.licence_names("This package is licensed under the GPL.\n") == ["unstructured"]


# ----------------------------------------------------------------------------------------------- extraction
def test_extract_documents_html_follows_include_and_exclude(tmp_path):
    root = tmp_path / "usr" / "share" / "doc" / "x" / "html"
    for rel in ("en/a.html", "en/_sources/a.html", "de/a.html", "en/b.txt"):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(f"<p>{rel} {PARAGRAPH}</p>")
    source = blc.Source("x", "html", "test", include=r"/html/en/", exclude=r"/_sources/")
    docs = list(blc.extract_documents(source, tmp_path))
    assert [i for i, _ in docs] == ["x:usr/share/doc/x/html/en/a.html"]
    assert docs[0][1].startswith("en/a.html The kernel")


@pytest.mark.skipif(not (shutil.which("groff") and shutil.which("col")), reason="needs groff and col")
def test_man_page_is_rendered_without_markup_and_so_links_are_skipped(tmp_path):
    page = tmp_path / "demo.1.gz"
    page.write_bytes(gzip.compress(b".TH DEMO 1\n.SH NAME\ndemo \\- show a demo\n.SH DESCRIPTION\n"
                                   b".B demo\nprints a \\fIdemonstration\\fR of nothing at all.\n"))
    text = blc.man_to_text(page)
    assert "NAME" in text and "demo - show a demo" in text.replace("\u2010", "-").replace("\u2212", "-")
    assert "demonstration of nothing at all." in text
    assert "\\f" not in text and "\b" not in text and ".SH" not in text
    alias = tmp_path / "alias.1.gz"
    alias.write_bytes(gzip.compress(b".so man1/demo.1\n"))
    assert blc.man_to_text(alias) == ""


# ----------------------------------------------------------------------------------------------- device subset
def test_select_subset_fills_the_budget_in_hash_order():
    rows = [(f"a:{i}", "t", 10) for i in range(20)] + [(f"b:{i}", "t", 25) for i in range(20)]
    chosen = blc.select_subset(rows, budget=200)
    ids = [i for i, _ in chosen]
    sizes = {i: n for i, _, n in rows}
    assert sum(sizes[i] for i in ids) <= 200
    assert sum(sizes[i] for i in ids) > 200 - 25  # nothing else would fit
    assert ids == sorted(ids, key=blc.hash_order)
    assert {i[0] for i in ids} == {"a", "b"}  # a sample of both sources, not the first one's documents


def test_device_subset_stays_within_its_token_budget(tmp_path):
    from tokenizers import Tokenizer

    from mixerlab.training.train_tokenizer import build_trainer

    texts = [f"document {i}: " + PARAGRAPH * (1 + i % 4) for i in range(60)]
    tok, trainer = build_trainer(300, 2, False)
    tok.train_from_iterator(texts, trainer=trainer)
    tok.save(str(tmp_path / "tokenizer.json"))
    for split, rows in (("train", texts[:50]), ("val", texts[50:])):
        (tmp_path / split).mkdir()
        pq.write_table(pa.table({"text": rows, "id": [f"p{i % 2}:{split}{i}" for i in range(len(rows))]}),
                       tmp_path / split / "part-00000.parquet")
    budget = 3000
    info = blc.write_device_subset(tmp_path, tmp_path / "tokenizer.json", budget)
    tok = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    subset = pq.read_table(tmp_path / "device" / "train" / "part-00000.parquet").column("text").to_pylist()
    tokens = sum(len(e.ids) + 1 for e in tok.encode_batch(subset))
    assert 0 < len(subset) < 50
    assert tokens == info["train_tokens_with_eos"] <= budget
    assert tokens > budget - max(len(e.ids) + 1 for e in tok.encode_batch(texts[:50]))
    val = pq.read_table(tmp_path / "device" / "val" / "part-00000.parquet").column("text").to_pylist()
    assert val == texts[50:]
    assert json.loads((tmp_path / "device" / "manifest.json").read_text())["train_docs"] == len(subset)
    assert (tmp_path / "device" / "tokenizer.json").read_bytes() == (tmp_path / "tokenizer.json").read_bytes()
    known: dict = {}
    blc.count_tokens(tmp_path / "train", tmp_path / "tokenizer.json", known)
    assert blc.write_device_subset(tmp_path, tmp_path / "tokenizer.json", budget, known) == info
    # parts: disjoint samples of the same budget, the next documents in hash order
    info = blc.write_device_subset(tmp_path, tmp_path / "tokenizer.json", budget, known, parts=3)
    files = [tmp_path / "device" / "train" / "part-00000.parquet"] + [
        tmp_path / "device_parts" / f"part-{k:05d}.parquet" for k in (1, 2)]
    ids = [pq.read_table(f).column("id").to_pylist() for f in files]
    assert all(ids) and sum(map(len, ids)) == len(set().union(*map(set, ids)))  # none empty, none shared
    assert [p["train_docs"] for p in info["more_parts"]] == [len(ids[1]), len(ids[2])]
    assert all(p["train_tokens_with_eos"] <= budget for p in info["more_parts"])
    known = {doc_id: 10 ** 6 for doc_id in known}  # counts are taken as given: nothing fits
    assert blc.write_device_subset(tmp_path, tmp_path / "tokenizer.json", budget, known)["train_docs"] == 0
    assert not (tmp_path / "device_parts").exists()  # a new subset clears the old parts


def test_select_subset_passes_over_a_document_too_large_for_the_rest_of_the_budget():
    small = [(f"s:{i}", "t", 10) for i in range(20)]
    big = ("big:0", "t", 1000)
    assert sorted(small + [big], key=lambda r: blc.hash_order(r[0]))[-1] != big  # big is not last in hash order
    chosen = blc.select_subset(small + [big], budget=200)
    assert sorted(i for i, _ in chosen) == sorted(i for i, _, _ in small)


def test_html_to_text_keeps_content_inside_an_unclosed_header_div():
    # Qt's reference pages open <div class="header"> and never close it before the content.
    text = blc.html_to_text('<body><div class="header"><div class="navigationbar"><ul><li>Qt 5</li></ul></div>'
                            '<div class="content"><p>QString holds Unicode text.</p></div></body>')
    assert text == "QString holds Unicode text."
