"""Two jax.distributed processes on localhost (CPU, gloo) share the run lock's outcome. Training, checkpointing and
resuming together (and against one process): test_multiprocess_equivalence.py."""
import json
import os
import socket
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(run_dir, steps, expect=0):
    port = _free_port()
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    common = ["--config", "configs/tiny.yaml", f"train.output_dir={run_dir}", f"train.steps={steps}",
              "train.log_every=1", "checkpoint.every=3", "train.eval_every=3", "optim.warmup_steps=2",
              "model.num_layers=1"]  # one block: the processes, not the depth, are under test (compiles: the time)
    procs = [subprocess.Popen([sys.executable, "train.py", "--coordinator_address", f"127.0.0.1:{port}",
                               "--num_processes", "2", "--process_id", str(i), *common],
                              cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(2)]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    for p, out in zip(procs, outs):
        assert p.returncode == expect, out
    return outs


def test_every_process_is_refused_when_the_run_directory_is_locked(tmp_path):
    """Process 0 alone takes the run lock; the refusal reaches every process (none waits at a collective)."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    try:
        (run_dir / "mixerlab.lock").write_text(json.dumps({
            "host": socket.gethostname(), "pid": holder.pid, "started": time.time(), "heartbeat": time.time(),
            "token": "another-trainer"}))
        outs = _launch(run_dir, steps=6, expect=2)
    finally:
        holder.kill()
        holder.wait()
    assert f"is in use by another trainer (host {socket.gethostname()}, pid {holder.pid}" in outs[0]
    assert "is in use by another trainer (process 0 names it)" in outs[1]
    assert sorted(os.listdir(run_dir)) == ["mixerlab.lock"]
