"""tools/gpu_lm_budget.sh without a GPU: a pipeline whose sweep runs all exist already (SWEEP_FROM) picks the LRs,
and `sweep-only` stops it there — no further LR round for a winner at its grid's end, no long runs."""
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(__file__))
from test_lm_compare_report import _run  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "tools", "gpu_lm_budget.sh")


def _budget(*args, **env):
    path = os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"]  # python3: this venv's
    return subprocess.run(["bash", SCRIPT, *args], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PATH": path, **env})


def test_sweep_only_stops_a_pipeline_after_its_pick(tmp_path):
    sweep, out = tmp_path / "earlier", tmp_path / "budget"
    sweep.mkdir()
    for lr, loss in (("7.5e-4", 3.8), ("1.5e-3", 3.6), ("3e-3", 3.5)):  # the top end wins: a round would follow
        _run(sweep, f"gdn2_lr{lr}", "gdn2", [(500, loss)], 500, 500)
    out.mkdir()
    (out / "pipeline.log").write_text("")
    asked = _budget("sweep-only", str(out))
    assert asked.returncode == 0 and (out / "sweep_only").exists(), asked.stderr
    done = _budget("pipeline", str(out), "gdn2=7.5e-4/1.5e-3/3e-3", SWEEP_FROM=str(sweep))
    assert done.returncode == 0, done.stderr
    assert "sweep-only: no further LR round" in done.stdout and "sweep-only: no long runs" in done.stdout
    assert "round 2" not in done.stdout and not (out / "long").exists()
    assert (out / "lr.txt").read_text().split() == ["gdn2", "0.003"]
    assert (out / "done").read_text().strip() == "0"
    again = _budget("sweep-only", str(out))  # an ended pipeline: said so, nothing asked
    assert again.returncode == 0 and "already ended" in again.stdout


def test_sweep_only_needs_a_started_pipeline(tmp_path):
    r = _budget("sweep-only", str(tmp_path / "nothing"))
    assert r.returncode == 2 and "no pipeline was started there" in r.stderr
