"""tools/bench_vla_gpu.py runs end to end at tiny sizes on CPU (--smoke --check --sweep-warps; the Triton kernels
in interpret mode): every row is timed (no error rows), the check agrees, and the JSON and Markdown are written."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.extended  # ~60 s: XLA:CPU compiles of both implementations
def test_smoke_run_writes_every_row(tmp_path):
    out = tmp_path / "bench.json"
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    run = subprocess.run([sys.executable, os.path.join(REPO_ROOT, "tools", "bench_vla_gpu.py"), "--smoke", "--check",
                          "--sweep-warps", "--out", str(out)], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads(out.read_text())
    ops = {row["op"] for row in result["training"]}
    assert ops == {"vla/xla", "vla/pallas_triton", "vla_a_pass/xla", "vla_a_pass/pallas_triton", "delta_rule/auto"}
    for row in result["training"]:
        assert "error" not in row, row
        assert row["fwd_ms"] > 0, row
        assert row.get("fwd_bwd_ms", 1.0) > 0 and ("fwd_bwd_ms" in row or "fwd_bwd_skipped" in row), row
    assert all("fwd_bwd_ms" in row for row in result["training"] if row["op"].startswith("vla_a_pass"))
    assert [("error" in row, row["fwd_bwd_ms"] > 0) for row in result["sweep"]] == [(False, True)]
    check = result["check"]
    assert "error" not in check, check
    assert check["A"] < 1e-5, check  # both A-passes in float32
    assert check["o"] < 2e-2 and check["S"] < 2e-2, check  # the Triton path's S-pass gets bf16 α̂ and k̂
    assert "| vla/pallas_triton |" in run.stdout and "check pallas_triton vs xla" in run.stdout
