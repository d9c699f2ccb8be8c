"""The Transformer baseline's compiled TPU train step holds no T×T buffer: splash attention (the default on
TPU) never materialises scores; the dense XLA path, the control, does."""
import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_SCRIPT = """
import json, re, sys
from mixerlab.training import config as config_lib
from mixerlab.training.aot import compile_train_step
T = 1024
found = {}
for impl in sys.argv[1:]:
    cfg = config_lib.load_config("configs/tiny.yaml", [
        "model.mixer=softmax", "model.num_layers=1", "model.d_model=256", "model.num_heads=2", "model.ffn_dim=512",
        "model.dtype=bfloat16", "mesh.data=1", "mesh.fsdp=-1", "train.batch_size=4", f"data.seq_len={T}",
        f"mixers.softmax.implementation={impl}"])
    compiled, _, _ = compile_train_step(cfg, "v5e:2x2", 512)
    found[impl] = sorted({s for s in re.findall(r"\\b(?:f32|bf16|pred|s32)\\[([\\d,]+)\\]", compiled.as_text())
                          if [int(d) for d in s.split(",")].count(T) >= 2})
print(json.dumps(found))
"""


@pytest.mark.tpu_compile
def test_tpu_train_step_has_no_sequence_squared_buffer():
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "ALLOW_MULTIPLE_LIBTPU_LOAD": "1",
           "TPU_ACCELERATOR_TYPE": "v5litepod-4", "TPU_WORKER_HOSTNAMES": "localhost"}
    # both compiles in one process: one interpreter and libtpu start instead of two
    out = subprocess.run([sys.executable, "-c", _SCRIPT, "auto", "xla"], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=900)
    assert out.returncode == 0, out.stdout + out.stderr
    found = json.loads(out.stdout.strip().splitlines()[-1])
    assert found["auto"] == [], f"T×T buffers in the splash-attention train step: {found['auto']}"
    assert found["xla"], "control: the dense path should hold T×T scores"
