"""tools/bench_prefill_memory.py: ending the benchmark ends the (config, mode) process it started."""
import os
import signal
import subprocess
import sys
import time

TOOLS = os.path.join(os.path.dirname(__file__), "..", "..", "tools")


def test_ending_the_benchmark_ends_its_child(tmp_path):
    pid_file = tmp_path / "child.pid"
    child = f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(120)"
    parent = (f"import sys; sys.path.insert(0, {os.path.abspath(TOOLS)!r}); import bench_prefill_memory; "
              f"bench_prefill_memory.run_child([sys.executable, '-c', {child!r}], 300)")
    proc = subprocess.Popen([sys.executable, "-c", parent])
    child_pid = None
    try:
        deadline = time.monotonic() + 60
        while not (pid_file.exists() and pid_file.read_text()) and time.monotonic() < deadline:
            time.sleep(0.1)
        child_pid = int(pid_file.read_text())
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=30)
        alive = True
        for _ in range(100):
            try:
                os.kill(child_pid, 0)
            except ProcessLookupError:
                alive = False
                break
            time.sleep(0.1)
    finally:  # nothing left sleeping when the test fails
        for pid in filter(None, (proc.pid, child_pid)):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.wait()
    assert rc == 128 + signal.SIGTERM
    assert not alive, "the child outlived the benchmark"
