"""tests/xdist_crash_retry.py: a test whose xdist worker dies is run again alone; the session passes only if it
then passes (a real pytest -n 2 session on a throwaway test file, its worker killed by SIGSEGV)."""
import os
import subprocess
import sys

import pytest

_TESTS = '''
import os, pathlib, signal

def test_dies(tmp_path):
    marker = pathlib.Path(os.environ["CRASH_MARKER"])
    if os.environ.get("CRASH_ALWAYS") or not marker.exists():
        marker.write_text("died once")
        os.kill(os.getpid(), signal.SIGSEGV)

def test_fine():
    pass
'''


def _session(tmp_path, always: bool):
    (tmp_path / "test_worker_dies.py").write_text(_TESTS)
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    here = os.path.dirname(os.path.abspath(__file__))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([here, os.environ.get("PYTHONPATH", "")]),
           "CRASH_MARKER": str(tmp_path / "marker"), "CRASH_ALWAYS": "1" if always else ""}
    return subprocess.run([sys.executable, "-m", "pytest", "-n", "2", "-p", "xdist_crash_retry", "-q",
                           "-p", "no:cacheprovider", "test_worker_dies.py"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("always", [False, True])
def test_a_crashed_test_is_run_again_alone_and_decides_the_session(tmp_path, always):
    r = _session(tmp_path, always)
    out = r.stdout
    assert "lost their xdist worker" in out and "test_worker_dies.py::test_dies" in out, out + r.stderr
    if always:
        assert r.returncode == 1 and "they did not pass" in out, out
    else:
        assert r.returncode == 0 and "they passed" in out, out
