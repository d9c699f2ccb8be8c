"""tools/ab_delta_rule_gpu.py: runs end to end in interpret mode on a tiny shape and prints one row per function."""
import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_ab_runs_every_variant_and_function(tmp_path):
    out = tmp_path / "ab.json"
    variants = {"fused": {"interpret": True}, "apart": {"interpret": True, "fuse_output": False}}
    proc = subprocess.run([sys.executable, "tools/ab_delta_rule_gpu.py", json.dumps(variants), "--shape", "1,64,1,16",
                           "--rounds", "1", "--calls", "1", "--chunk", "32", "--leaf", "8", "--out", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result.pop("rounds") == 1  # written after every round
    assert set(result) == {f"{v} {f}" for v in variants for f in ("fwd", "fwd+bwd", "K1")}
    assert all(median >= fastest > 0 for median, fastest in result.values())
    assert "| fused fwd |" in proc.stdout and "round 1/1" in proc.stderr


def test_bad_shape_names_the_valid_forms():
    proc = subprocess.run([sys.executable, "tools/ab_delta_rule_gpu.py", "{}", "--shape", "8x"], cwd=REPO,
                          capture_output=True, text=True, timeout=300, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert proc.returncode == 2 and "B,T,H,D" in proc.stderr
