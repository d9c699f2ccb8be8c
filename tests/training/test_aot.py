"""--compile_only: the real train step compiles for TPU topologies through libtpu (no TPU needed)."""
import json
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
    if topology == "v5e:2x2":  # the estimate's FLOPs: per-token FLOPs + attention over whole rows
        from mixerlab.training import flop_model
        from mixerlab.training.config import load_config
        from mixerlab.training.loop import Trainer

        cfg = load_config("configs/tiny.yaml", ["mesh.data=1", "mesh.fsdp=1"])
        count = flop_model.training_flops(cfg, Trainer(cfg, 8192).abstract_params, 8192)
        b, t = cfg.train.batch_size, cfg.data.seq_len
        want = count.per_token * b * t + count.per_attention_pair * b * t * (t + 1) / 2
        line = next(x for x in out.stdout.splitlines() if x.startswith("model FLOPs / step"))
        assert float(line.split()[4]) == pytest.approx(want, rel=1e-4), line
        assert "of the 197 TFLOP/s dense bf16 peak" in out.stdout


def _report(model_flops, seconds, topology="v5e:2x2", chips=4):
    from mixerlab.training.aot import CompileReport

    return CompileReport(topology=topology, chips=chips, mesh={}, params=1, param_bytes_per_chip=0,
                         opt_bytes_per_chip=0, temp_bytes_per_chip=0, total_bytes_per_chip=0,
                         hbm_bytes_per_chip=None, model_flops_per_step=model_flops, compiler_flops_per_chip=None,
                         compiler_bytes_per_chip=None, compiler_seconds=seconds, compile_seconds=0.0)


def test_compile_only_estimate_uses_the_datasheet_peak_and_refuses_above_100_percent():
    assert _report(0.5 * 4 * 197e12 * 0.2, 0.2).estimated_mfu() == pytest.approx(0.5)  # v5e: 197 TFLOP/s
    assert _report(0.5 * 4 * 918e12 * 0.2, 0.2, "v6e:2x2").estimated_mfu() == pytest.approx(0.5)
    assert _report(1e12, 0.2, "v9x:2x2").estimated_mfu() is None  # no peak known: no MFU
    too_fast = _report(2 * 4 * 197e12 * 0.2, 0.2)
    line = next(x for x in too_fast.table().splitlines() if x.startswith("estimated MFU"))
    assert "refused" in line and "200.0 % is above 100 %" in line and "v5e:2x2" in line
    assert "3.1520e+14 model FLOPs" in line


@pytest.mark.extended  # 4-5 min on 2 cores; the tiny-config compile above keeps the --compile_only path in make test
def test_muir_166m_compiles_for_v5e_2x2_and_reports_memory():
    # The Muir model of configs/paper/muir_166m.yaml (every width, the 32K vocabulary) with two of its twelve
    # layers and a reduced batch (8 × 1024 tokens instead of 128 × 4096), so that the CPU compile stays within
    # CI's budget; the layers are identical, so the program per layer is the paper model's. One remat policy
    # (the config's auto would compile each candidate first).
    out = _compile_only("configs/paper/muir_166m.yaml", "v5e:2x2", "data.seq_len=1024", "train.batch_size=8",
                        "model.num_layers=2", "model.remat=kernels")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "v5e:2x2 (4 chips)" in out.stdout
    assert "parameters" in out.stdout and "total / chip" in out.stdout and "fits yes" in out.stdout


_SHAPES_SCRIPT = """
import json, re, sys
from mixerlab.training import config as config_lib
from mixerlab.training.aot import compile_train_step
import mixerlab.models.sharding  # noqa: F401
from mixerlab import models
if sys.argv[1] == "unconstrained":  # the control: what XLA does without the activation constraints
    models.sharding.constrain_batch = lambda x: x
    import mixerlab.models.decoder  # noqa: F401
    from mixerlab import models
    models.decoder.constrain_batch = lambda x: x
cfg = config_lib.load_config("configs/tiny.yaml", ["mesh.data=1", "mesh.fsdp=-1", "train.batch_size=8",
                                                  "data.seq_len=128", "model.d_model=256", "model.ffn_dim=1024"])
compiled, trainer, _ = compile_train_step(cfg, "v5e:2x2", 4096)
shapes = set(re.findall(r"\\[(\\d+),128,(\\d+)\\]", compiled.as_text()))  # [rows, T, width] buffers
print(json.dumps(sorted({(int(rows), int(width)) for rows, width in shapes})))
"""


@pytest.mark.extended  # test_sharding's FSDP step equality stays in make test; this adds the compiled layout check
def test_activations_stay_batch_sharded_under_fsdp():
    # 8 sequences on a 4-chip FSDP mesh: every chip holds 2 rows of every [B, T, ·] activation. Without the
    # activation constraints (models/sharding.py) XLA kept e.g. the logits of the whole batch on every chip,
    # so the temporaries grew with the slice (docs/benchmarks/aot_compile.md); the control run shows it.
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "ALLOW_MULTIPLE_LIBTPU_LOAD": "1",
           "TPU_ACCELERATOR_TYPE": "v5litepod-4", "TPU_WORKER_HOSTNAMES": "localhost"}
    rows_by_mode = {}
    for mode in ("constrained", "unconstrained"):
        out = subprocess.run([sys.executable, "-c", _SHAPES_SCRIPT, mode], cwd=REPO, env=env, capture_output=True,
                             text=True, timeout=1500)
        assert out.returncode == 0, out.stdout + out.stderr
        rows_by_mode[mode] = [tuple(pair) for pair in json.loads(out.stdout.strip().splitlines()[-1])]
    # full-width activations: the residual stream (256), the FFN (1024), the logits (4096). (The embedding
    # lookup legitimately gathers all 8 rows of its 64-column shard, [8, 128, 64], before resharding.)
    full = lambda mode: {rows for rows, width in rows_by_mode[mode] if width in (256, 1024, 4096)}  # noqa: E731
    assert full("constrained") == {2}, rows_by_mode
    assert 8 in full("unconstrained"), rows_by_mode  # the control: the test can tell the difference


def test_a_program_that_does_not_fit_says_so_and_what_to_try():
    # 64 sequences of 4096 tokens per chip with an 8192-token vocabulary: the logits alone exceed v5e's 16 GiB.
    out = _compile_only("configs/tiny.yaml", "v5e:2x2", "mesh.data=1", "mesh.fsdp=-1", "data.seq_len=4096",
                        "train.batch_size=256")
    assert out.returncode == 1, out.stdout + out.stderr
    assert "does not fit on v5e:2x2" in out.stderr and "exceeds available HBM" in out.stderr, out.stderr
    assert "train.loss_chunk" in out.stderr and "train.microbatches" in out.stderr and "mesh.fsdp" in out.stderr


def test_remat_auto_picks_a_policy_for_the_topology_hbm():
    """model.remat=auto on an abstract TPU topology: the chip's HBM is the limit (v5e: 16 GiB), and the tiny
    model's step fits without recomputation."""
    out = _compile_only("configs/tiny.yaml", "v5e:2x2", "mesh.data=1", "mesh.fsdp=-1", "model.remat=auto")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "model.remat=auto -> 'none'" in out.stdout + out.stderr
    assert "of 14.4 GiB (90% of 16.0 GiB)" in out.stdout + out.stderr
