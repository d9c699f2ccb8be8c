"""The mutation catalogue (tools/mutations.py) still matches the code: every declared snippet occurs exactly
once in its file and every declared test file exists. A refactor that renames or rewrites a line fails here,
loudly and by name, instead of leaving ``tools/mutation.py`` to test nothing."""
from __future__ import annotations

import os
import subprocess
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_every_declared_mutation_matches_the_code():
    run = subprocess.run([sys.executable, os.path.join(REPO_ROOT, "tools", "mutation.py"), "--check"],
                         cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "(all)" in run.stdout


def test_check_names_a_missing_and_an_ambiguous_snippet(tmp_path):
    sys.path.insert(0, os.path.join(REPO_ROOT, "tools"))
    try:
        from mutation import check_catalogue
        from mutations import Mutant
    finally:
        sys.path.pop(0)
    (tmp_path / "tests").mkdir()
    (tmp_path / "m.py").write_text("x = 1\ny = x + 1\ny = x + 1\n")
    problems = check_catalogue([Mutant("gone", "m.py", "z = 2", "z = 3", "", ("tests/",)),
                                Mutant("twice", "m.py", "y = x + 1", "y = x - 1", "", ("tests/",)),
                                Mutant("fine", "m.py", "x = 1", "x = 2", "", ("tests/",))], root=str(tmp_path))
    assert len(problems) == 2, problems
    assert problems[0].startswith("gone (m.py): snippet missing")
    assert problems[1].startswith("twice (m.py): snippet ambiguous (2 occurrences)")
