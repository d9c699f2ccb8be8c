"""Every test module collects without the optional extras (eval, cloud, tracking, data, dev's moto, cuda's
jax-triton, ...): a package that not every install has is imported inside the tests that need it, after
``pytest.importorskip`` of it (or a module-level ``pytest.importorskip`` when every test of the module needs it),
never by a plain module-level import, directly or through a mixerlab module that imports it at its top."""
import ast
import os

import pytest

TESTS = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(TESTS)
# the import names of pyproject's optional extras and of the packages they bring (not in [project] dependencies)
OPTIONAL = {"lm_eval", "moto", "wandb", "tensorboard", "xprof", "datasets", "fsspec", "gcsfs", "s3fs", "boto3",
            "botocore", "google", "jax_triton", "triton", "torch", "fla", "transformers"}


def _test_files():
    for root, dirs, files in os.walk(TESTS):
        dirs[:] = [d for d in dirs if d != "__pycache__" and d != "data"]
        for name in sorted(files):
            if name.endswith(".py"):
                yield os.path.join(root, name)


def _module_level(tree):
    """Statements run at import time: the module body, descending into if/try/with but not into defs."""
    todo = list(tree.body)
    while todo:
        node = todo.pop(0)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        yield node
        for field in ("body", "orelse", "finalbody", "handlers"):
            todo.extend(getattr(node, field, []) or [])


def _imported(node) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
        return [node.module] + [f"{node.module}.{a.name}" for a in node.names]
    return []


def _skipped(tree) -> set[str]:
    """Roots passed to pytest.importorskip anywhere in the module."""
    out = set()
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "importorskip" and node.args
                and isinstance(node.args[0], ast.Constant)):
            out.add(node.args[0].value.split(".")[0])
    return out


def _source_of(module: str) -> str | None:
    """The file of a mixerlab.<folder>... module in this checkout (None for packages or other names)."""
    parts = module.split(".")
    if parts[0] != "mixerlab" or len(parts) < 2:
        return None
    path = os.path.join(REPO, *parts[1:]) + ".py"
    return path if os.path.isfile(path) else None


def _top_level_optional(path: str) -> set[str]:
    tree = ast.parse(open(path).read())
    return {name.split(".")[0] for node in _module_level(tree) for name in _imported(node)} & OPTIONAL


def violations(path: str) -> list[str]:
    tree = ast.parse(open(path).read())
    skipped_first = set()  # module-level importorskip calls seen so far, in order
    found = []
    for node in _module_level(tree):
        if isinstance(node, (ast.Expr, ast.Assign)):
            skipped_first |= _skipped(node)
        for name in _imported(node):
            root = name.split(".")[0]
            if root in OPTIONAL and root not in skipped_first:
                found.append(f"line {node.lineno}: module-level import of {root}")
            src = _source_of(name)
            for dep in sorted(_top_level_optional(src) - skipped_first) if src else ():
                found.append(f"line {node.lineno}: {name} imports {dep} at its top")
    skipped_anywhere = _skipped(tree)
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for node in ast.walk(fn):
                for name in _imported(node):
                    root = name.split(".")[0]
                    if root in OPTIONAL and root not in skipped_anywhere:
                        found.append(f"line {node.lineno}: {root} imported in {fn.name} without "
                                     f"pytest.importorskip({root!r})")
    return sorted(set(found))


@pytest.mark.parametrize("path", list(_test_files()), ids=lambda p: os.path.relpath(p, TESTS))
def test_optional_packages_are_imported_behind_importorskip(path):
    assert not violations(path), f"{os.path.relpath(path, REPO)}: " + "; ".join(violations(path))


def test_the_checker_catches_a_module_level_import(tmp_path):
    bad = tmp_path / "test_bad.py"
    bad.write_text("import pytest\nfrom lm_eval import simple_evaluate\nimport mixerlab.eval.lm_eval_adapter\n\n"
                   "def test_x():\n    import moto\n")
    assert violations(str(bad)) == ["line 2: module-level import of lm_eval",
                                     "line 3: mixerlab.eval.lm_eval_adapter imports lm_eval at its top",
                                     "line 6: moto imported in test_x without pytest.importorskip('moto')"]
    good = tmp_path / "test_good.py"
    good.write_text("import pytest\nlm_eval = pytest.importorskip('lm_eval')\nfrom lm_eval import simple_evaluate\n")
    assert violations(str(good)) == []
