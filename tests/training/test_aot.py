"""--compile_only: the real train step compiles for TPU topologies through libtpu (no TPU needed)."""
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

pytestmark = pytest.mark.tpu_compile


def _compile_only(config, topology, *overrides):
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "ALLOW_MULTIPLE_LIBTPU_LOAD": "1",
           "TPU_ACCELERATOR_TYPE": "v5litepod-4", "TPU_WORKER_HOSTNAMES": "localhost"}
    return subprocess.run([sys.executable, "train.py", "--config", config, "--compile_only", "--topology", topology,
                           *overrides], cwd=REPO, env=env, capture_output=True, text=True, timeout=1500)


@pytest.mark.parametrize("topology", ["v5e:2x2", "v6e:2x2", "v5p:2x2x1"])
def test_tiny_model_compiles_for_tpu_generations(topology):
    out = _compile_only("configs/tiny.yaml", topology, "mesh.data=1", "mesh.fsdp=-1")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "fits yes" in out.stdout and "params / chip" in out.stdout


@pytest.mark.slow
def test_muir_166m_compiles_for_v5e_2x2_and_reports_memory():
    # The 166M Muir model exactly as configs/paper/muir_166m.yaml defines it; the batch shape is reduced
    # (8 × 1024 tokens instead of 128 × 4096) so that the CPU compile stays within CI's budget.
    out = _compile_only("configs/paper/muir_166m.yaml", "v5e:2x2", "data.seq_len=1024", "train.batch_size=8")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "v5e:2x2 (4 chips)" in out.stdout
    assert "parameters" in out.stdout and "total / chip" in out.stdout and "fits yes" in out.stdout
