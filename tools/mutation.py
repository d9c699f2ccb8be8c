"""Mutation testing of the critical paths: apply one DECLARED bug (tools/mutations.py) at a time to a copy of
the repository, run the tests that should catch it, and report which bugs the suite kills.

    python tools/mutation.py                 # every mutant, one at a time
    python tools/mutation.py --jobs 2        # two mutants at once (each in its own copy)
    python tools/mutation.py --only NAME     # one mutant (repeatable; a trailing * matches a prefix)
    python tools/mutation.py --list          # the catalogue
    python tools/mutation.py --check         # every snippet occurs exactly once (no tests run; fast)
    python tools/mutation.py --baseline      # run each mutant's tests on the UNmutated copy (must pass)

The working tree is never modified: the tracked and untracked-but-not-ignored files are copied into one
temporary directory per job; a mutant is written there, its tests run with ``-x`` and a timeout, and the
file is restored. Exit status: 0 when every mutant is killed (or, with --check, every snippet is found
exactly once), 1 otherwise.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import fnmatch
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from mutations import MUTANTS, Mutant  # noqa: E402

DEFAULT_TIMEOUT_S = 420


# ------------------------------------------------------------------------------------------------- check
def check_catalogue(mutants, root=REPO_ROOT) -> list[str]:
    """One message per problem: unknown file, snippet missing or not unique, replacement equal to the
    original, duplicate names, no tests. Empty list = the catalogue matches the code."""
    problems, seen = [], set()
    for m in mutants:
        where = f"{m.name} ({m.file})"
        if m.name in seen:
            problems.append(f"{where}: duplicate mutant name")
        seen.add(m.name)
        if m.original == m.replacement:
            problems.append(f"{where}: replacement equals the original snippet")
        if not m.tests:
            problems.append(f"{where}: no tests declared")
        path = os.path.join(root, m.file)
        if not os.path.isfile(path):
            problems.append(f"{where}: file not found")
            continue
        with open(path, encoding="utf-8") as f:
            count = f.read().count(m.original)
        if count != 1:
            state = "missing" if count == 0 else f"ambiguous ({count} occurrences)"
            problems.append(f"{where}: snippet {state}: {m.original!r}")
        for test in m.tests:
            test_file = test.split("::")[0]
            if test_file.startswith("tests/") and not os.path.exists(os.path.join(root, test_file)):
                problems.append(f"{where}: test path not found: {test_file}")
    return problems


# ------------------------------------------------------------------------------------------------- run
def _project_files(root):
    out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=root, check=True,
                         capture_output=True).stdout.decode()
    return [p for p in out.split("\0") if p and (os.path.isfile(os.path.join(root, p))
                                                   or os.path.islink(os.path.join(root, p)))]


def make_copy(root) -> str:
    dest = tempfile.mkdtemp(prefix="mixerlab-mutation-")
    for rel in _project_files(root):
        target = os.path.join(dest, rel)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        if os.path.islink(os.path.join(root, rel)):  # mixerlab/<folder> -> ../<folder>: the copy's own folders
            os.symlink(os.readlink(os.path.join(root, rel)), target)
        else:
            shutil.copy2(os.path.join(root, rel), target)
    return dest


def _env(copy_dir):
    env = dict(os.environ)
    # The copy, not the editable install of the main checkout, must provide the project's packages.
    env["PYTHONPATH"] = copy_dir + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["PYTHONDONTWRITEBYTECODE"] = "1"  # a restored file must never be shadowed by a mutant's .pyc
    env.setdefault("JAX_PLATFORMS", "cpu")
    return env


def assert_copy_is_imported(copy_dir):
    """The tests must import the mutated copy: fail loudly if the packages resolve elsewhere."""
    code = ("from mixerlab import pallas_kernels, training, mixers; "
            "print(pallas_kernels.__file__, training.__file__, mixers.__file__)")
    out = subprocess.run([sys.executable, "-c", code], cwd=copy_dir, env=_env(copy_dir), capture_output=True,
                         text=True, check=True).stdout
    real = os.path.realpath(copy_dir)
    for path in out.split():
        if not os.path.realpath(path).startswith(real + os.sep):
            raise SystemExit(f"mutation: the tests would import {path}, not the copy in {copy_dir}")


_FAILED = re.compile(r"^(?:FAILED|ERROR) (\S+)", re.MULTILINE)


def run_tests(copy_dir, tests, timeout_s):
    """(status, first failing test, seconds, output tail); status is passed/failed/timeout/error/no-tests/broken."""
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-rfE", *tests]
    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=copy_dir, env=_env(copy_dir), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        return "timeout", "", time.monotonic() - start, output[-3000:]
    seconds = time.monotonic() - start
    if proc.returncode == 0:
        return "passed", "", seconds, output[-3000:]
    if proc.returncode == 5:
        return "no-tests", "", seconds, output[-3000:]
    if proc.returncode in (3, 4):  # pytest internal or usage error (e.g. a declared node id does not exist)
        return "broken", "", seconds, output[-3000:]
    failed = _FAILED.findall(output)
    status = "failed" if proc.returncode == 1 else "error"  # 2: interrupted by a collection/import error
    return status, failed[0] if failed else "(collection)", seconds, output[-3000:]


def run_mutant(m: Mutant, copy_dir, timeout_s, *, baseline=False) -> dict:
    path = os.path.join(copy_dir, m.file)
    with open(path, encoding="utf-8") as f:
        original = f.read()
    if original.count(m.original) != 1:
        return dict(name=m.name, result="BROKEN", test="snippet not found exactly once", seconds=0.0, tail="")
    try:
        if not baseline:
            with open(path, "w", encoding="utf-8") as f:
                f.write(original.replace(m.original, m.replacement))
        status, test, seconds, tail = run_tests(copy_dir, m.tests, timeout_s)
    finally:
        with open(path, "w", encoding="utf-8") as f:
            f.write(original)
    if baseline:
        result = "ok" if status == "passed" else "BASELINE-" + status.upper()
    else:
        result = {"failed": "killed", "error": "killed", "passed": "SURVIVED", "timeout": "TIMEOUT",
                  "no-tests": "NO-TESTS", "broken": "BROKEN"}[status]
    return dict(name=m.name, result=result, test=test, seconds=seconds, tail=tail)


def select(mutants, only):
    if not only:
        return list(mutants)
    chosen = [m for m in mutants if any(fnmatch.fnmatchcase(m.name, pattern) for pattern in only)]
    unknown = [p for p in only if not any(fnmatch.fnmatchcase(m.name, p) for m in mutants)]
    if unknown:
        raise SystemExit(f"mutation: no mutant named {', '.join(unknown)} (see --list)")
    return chosen


def _table(rows, headers):
    widths = [max(len(str(r[i])) for r in [headers, *rows]) for i in range(len(headers))]
    line = lambda r: "  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip()  # noqa: E731
    return "\n".join([line(headers), line(["-" * w for w in widths]), *map(line, rows)])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", action="append", metavar="NAME", help="run only this mutant (glob; repeatable)")
    parser.add_argument("--list", action="store_true", help="print the catalogue and exit")
    parser.add_argument("--check", action="store_true", help="verify every snippet occurs exactly once; run nothing")
    parser.add_argument("--baseline", action="store_true", help="run each mutant's tests without the mutation")
    parser.add_argument("--jobs", type=int, default=1, help="mutants run at once, each in its own copy (default 1)")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, help="seconds per mutant's tests")
    parser.add_argument("--verbose", action="store_true", help="print the pytest output tail of survivors")
    args = parser.parse_args(argv)
    mutants = select(MUTANTS, args.only)

    if args.list:
        rows = [(m.name, m.file, m.description, " ".join(m.tests)) for m in mutants]
        print(_table(rows, ("mutant", "file", "bug", "tests")))
        print(f"{len(mutants)} mutants")
        return 0
    problems = check_catalogue(mutants)
    if args.check or problems:
        for p in problems:
            print(f"mutation --check: {p}")
        print(f"mutation --check: {len(mutants) - len({p.split(' ')[0] for p in problems})} of {len(mutants)} "
              f"declarations match the code" + ("" if problems else " (all)"))
        return 1 if problems else 0

    copies = queue.Queue()
    for _ in range(max(1, min(args.jobs, len(mutants)))):
        copy_dir = make_copy(REPO_ROOT)
        copies.put(copy_dir)
    assert_copy_is_imported(copies.queue[0])

    def work(m):
        copy_dir = copies.get()
        try:
            row = run_mutant(m, copy_dir, args.timeout, baseline=args.baseline)
        finally:
            copies.put(copy_dir)
        print(f"  {row['result']:<9} {row['seconds']:6.1f}s  {m.name}  {row['test']}", flush=True)
        return row

    start = time.monotonic()
    print(f"mutation: {len(mutants)} mutants, {args.jobs} job(s), timeout {args.timeout:.0f}s each", flush=True)
    try:
        with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
            rows = list(pool.map(work, mutants))
    finally:
        while not copies.empty():
            shutil.rmtree(copies.get(), ignore_errors=True)
    by_name = {m.name: m for m in mutants}
    table = [(r["name"], by_name[r["name"]].file, r["result"], r["test"] or "-", f"{r['seconds']:.1f}s")
             for r in rows]
    print()
    print(_table(table, ("mutant", "file", "result", "killed by", "time")))
    total = time.monotonic() - start
    if args.baseline:
        bad = [r for r in rows if r["result"] != "ok"]
        print(f"\nbaseline: {len(rows) - len(bad)} of {len(rows)} test selections pass unmutated ({total:.0f}s)")
        return 1 if bad else 0
    killed = sum(r["result"] == "killed" for r in rows)
    print(f"\nmutation score: {killed}/{len(rows)} killed = {100.0 * killed / max(len(rows), 1):.1f}% "
          f"({total:.0f}s wall, {args.jobs} job(s))")
    survivors = [r for r in rows if r["result"] != "killed"]
    for r in survivors:
        print(f"not killed: {r['name']} [{r['result']}] {by_name[r['name']].description}")
        if args.verbose:
            print(r["tail"])
    return 1 if survivors else 0


if __name__ == "__main__":
    sys.exit(main())
