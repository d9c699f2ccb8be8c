"""A test whose pytest-xdist worker died (a segfault in a library's native code) is run once more, alone, in a
fresh process at the end of the session; the session passes only if every such test then passes and nothing
else failed. A test that fails, or that crashes again, still fails the session.

Why: on 2026-12-07 one clean-clone run of `make test` lost a worker to a segmentation fault inside JAX's
persistent compilation cache, while it serialised a CPU executable (`compilation_cache.put_executable_and_time`
→ `executable.serialize()`, jax 0.10.2), in a trainer test that passes on every other run. pytest-xdist
reports such a crash as a failure of the test that was running, whatever its scheduler does next (`--dist load`
does not run the test again; `--dist loadgroup` queues the test's group again, and has also been seen to wait
for ever instead, which this plugin cannot mend), so this plugin runs it once more, alone, after the others. The
crash and the rerun are both printed.

Loaded by tests/conftest.py (which imports the two hooks); the hooks do nothing in a run without xdist.
"""
from __future__ import annotations

import re
import subprocess
import sys

import pytest

_crashed: list[str] = []  # node ids of tests whose worker died, in the controller process


@pytest.hookimpl(optionalhook=True)  # a pytest-xdist hook: absent under -p no:xdist
def pytest_handlecrashitem(crashitem, report, sched):
    _crashed.append(crashitem)


def _plain_node_id(node_id: str) -> str:
    """The id pytest accepts on its command line: without the ``@group`` that --dist loadgroup appends."""
    return re.sub(r"@[^@\[\]]+$", "", node_id)


def pytest_sessionfinish(session, exitstatus):
    if hasattr(session.config, "workerinput") or not _crashed:
        return
    say = session.config.pluginmanager.get_plugin("terminalreporter")
    write = say.write_line if say is not None else print
    ids = sorted({_plain_node_id(node_id) for node_id in _crashed})
    write(f"mixerlab: {len(ids)} test(s) lost their xdist worker (a crash, printed above): {', '.join(ids)}")
    if session.testsfailed > len(_crashed):
        write("mixerlab: other tests failed too; the crashed ones are not run again")
        return
    rerun = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:xdist", "-q", "-p", "no:cacheprovider", *ids],
                           cwd=str(session.config.rootpath), capture_output=True, text=True)
    tail = "\n".join(rerun.stdout.strip().splitlines()[-15:])
    if rerun.returncode == 0:
        write(f"mixerlab: run again alone in a fresh process, they passed:\n{tail}")
        session.exitstatus = pytest.ExitCode.OK
    else:
        write(f"mixerlab: run again alone in a fresh process, they did not pass (exit {rerun.returncode}):\n{tail}"
              f"\n{rerun.stderr.strip()[-2000:]}")
