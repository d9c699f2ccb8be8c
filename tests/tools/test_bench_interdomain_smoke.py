"""tools/bench_interdomain_gpu.py runs end to end at tiny sizes on CPU (--smoke --check): every training row and
every decode row is timed (no error rows; the GPU-only kernel is recorded as refused), and the JSON and the
Markdown tables are written."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
KERNELS = {"interdomain/pallas_tpu": "needs a TPU backend", "interdomain/pallas_triton": "GPU only"}  # and why


@pytest.mark.extended  # a benchmark tool's smoke run; the op's own tests stay in make test
@pytest.mark.slow
def test_smoke_run_writes_every_row(tmp_path):
    out = tmp_path / "bench.json"
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    run = subprocess.run([sys.executable, os.path.join(REPO_ROOT, "tools", "bench_interdomain_gpu.py"), "--smoke",
                          "--check", "--out", str(out)], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads(out.read_text())
    ops = {row["op"] for row in result["training"]}
    assert {"interdomain/xla", "interdomain/pallas_triton", "attention/xla", "delta_rule/auto"} <= ops, ops
    for row in result["training"]:
        assert "error" not in row, row
        if row["op"] in KERNELS:  # recorded with the reason each kernel refuses the CPU
            assert KERNELS[row["op"]] in row["skipped"], row
            continue
        assert row["fwd_ms"] > 0, row
        assert row.get("fwd_bwd_ms", 1.0) > 0 and ("fwd_bwd_ms" in row or "fwd_bwd_skipped" in row), row
    toeplitz = {"interdomain/toeplitz", "interdomain/toeplitz_16bit"}
    assert {row["op"] for row in result["check"]} == {*KERNELS, *toeplitz}, result["check"]
    for row in result["check"]:
        if row["op"] in KERNELS:
            assert KERNELS[row["op"]] in row["skipped"] and f"| {row['op']} | refused |" in run.stdout, row
        else:  # the Toeplitz forms run on the CPU: output and gradients against xla (bf16 inputs)
            errors = [row[n] for n in ("o", "dq", "dk", "dv", "dlog_modulus", "dphase", "dgain", "dreadout")]
            assert "error" not in row and max(errors) <= 1e-2, row
    decode = {(row["mixer"], row["prefix"]) for row in result["decode"]}
    assert decode == {(m, p) for m in ("interdomain", "softmax") for p in (8, 16)}, decode
    for row in result["decode"]:
        assert "error" not in row and row["ms"] > 0 and row["cache_bytes"] > 0, row
    softmax = sorted((r["prefix"], r["cache_bytes"]) for r in result["decode"] if r["mixer"] == "softmax")
    assert softmax[0][1] < softmax[1][1]  # the KV cache grows with the prefix, the interdomain state does not
    inter = {r["cache_bytes"] for r in result["decode"] if r["mixer"] == "interdomain"}
    assert len(inter) == 1
    assert "| interdomain/xla |" in run.stdout and "| B | prefix | interdomain | softmax |" in run.stdout


@pytest.mark.extended  # ~40 s: four processes of tiny models; the prefill itself is tested in tests/models
def test_bench_prefill_memory_smoke(tmp_path):
    out = tmp_path / "prefill.json"
    done = subprocess.run([sys.executable, "tools/bench_prefill_memory.py", "--smoke", "--out", str(out)],
                          capture_output=True, text=True, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert done.returncode == 0, done.stderr[-2000:]
    rows = json.loads(out.read_text())
    assert len(rows) == 8 and all("error" not in r for r in rows), rows
    assert {r["mode"] for r in rows} == {"full", "chunked"}
