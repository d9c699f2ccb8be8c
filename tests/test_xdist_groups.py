"""``--dist loadgroup`` keeps an ``xdist_group`` on one worker (tests/conftest.py's collection hook): a throwaway
suite of a six-test group and six ungrouped tests, run with two workers, puts the whole group on one worker."""
import os
import re
import subprocess
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_CONFTEST = f"""
import sys
sys.path.insert(0, {REPO_ROOT!r})
from tests.conftest import pytest_collection_modifyitems  # noqa: F401  (the hook under test)
"""

_TESTS = """
import time
import pytest


@pytest.mark.xdist_group("together")
@pytest.mark.parametrize("i", range(6))
def test_grouped(i):
    time.sleep(0.05)


@pytest.mark.parametrize("i", range(6))
def test_free(i):
    time.sleep(0.05)
"""


def test_an_xdist_group_runs_on_one_worker(tmp_path):
    (tmp_path / "conftest.py").write_text(_CONFTEST)
    (tmp_path / "test_groups.py").write_text(_TESTS)
    out = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-n", "2", "--dist", "loadgroup",
                          "-v", "test_groups.py"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    runs = re.findall(r"\[(gw\d)\].*PASSED test_groups.py::(test_\w+)\[(\d)\]", out.stdout)
    assert len(runs) == 12, out.stdout
    grouped = {worker for worker, name, _ in runs if name == "test_grouped"}
    assert len(grouped) == 1, f"the group ran on {sorted(grouped)}:\n{out.stdout}"
    assert {worker for worker, _, _ in runs} == {"gw0", "gw1"}, out.stdout  # both workers did run tests
