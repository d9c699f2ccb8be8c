"""Two jax.distributed processes on localhost (CPU, gloo) train, checkpoint and resume together."""
import json
import os
import socket
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(run_dir, steps):
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
        assert p.returncode == 0, out
    return outs


@pytest.mark.slow
def test_two_processes_train_checkpoint_and_resume(tmp_path):
    run_dir = tmp_path / "run"
    outs = _launch(run_dir, steps=6)
    assert "2 cpu device(s)" in outs[0]
    assert "mixerlab:" not in outs[1]  # only process 0 prints and logs
    assert sorted(os.listdir(run_dir / "checkpoints")) == ["3", "6"]
    rows = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    assert [r["step"] for r in rows if r["split"] == "train"] == [1, 2, 3, 4, 5, 6]

    outs = _launch(run_dir, steps=9)
    assert "resuming at step 6" in outs[0]
    rows = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    assert [r["step"] for r in rows if r["split"] == "train"] == list(range(1, 10))
    assert sorted(os.listdir(run_dir / "checkpoints")) == ["3", "6", "9"]
    state = json.load(open(run_dir / "checkpoints" / "9" / "data" / "metadata"))
    assert len(state["per_process"]) == 2 and state["per_process"][0] != state["per_process"][1]
