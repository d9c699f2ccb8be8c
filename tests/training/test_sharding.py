"""Sharded training on 8 virtual CPU devices equals the single-device step; sharding rules behave."""
import os
import subprocess
import sys
import textwrap

import pytest
from jax.sharding import PartitionSpec as P

from mixerlab.training import mesh as mesh_lib

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_SCRIPT = textwrap.dedent("""
    import jax, numpy as np
    assert jax.device_count() == 8, jax.devices()
    from mixerlab.training.config import load_config
    from mixerlab.training.loop import Trainer
    from mixerlab.training import mesh as mesh_lib, data as data_lib
    from mixerlab.training.tokenizer import load_tokenizer

    def run(mesh_args, devices):
        # one block: it holds every parameter kind the sharding rules place (the compiles are the time)
        cfg = load_config("configs/tiny.yaml", ["model.d_model=64", "model.num_layers=1", "train.batch_size=8",
                                                *mesh_args])
        tok = load_tokenizer(cfg.data.tokenizer.kind, cfg.data.tokenizer.path)
        trainer = Trainer(cfg, tok.vocab_size, mesh=mesh_lib.make_mesh(cfg, devices))
        trainer.initialize()
        it = data_lib.train_iterator(cfg.data, tok, global_batch_size=8, seed=0)
        losses = []
        for _ in range(3):
            trainer.params, trainer.opt_state, m = trainer.train_step(trainer.params, trainer.opt_state,
                                                                      trainer.global_batch(next(it)))
            losses.append(float(m["loss"]))
        specs = {str(s.spec) for s in jax.tree.leaves(trainer.param_shardings)}
        return losses, jax.tree.map(np.asarray, trainer.params), specs

    single, p1, _ = run(["mesh.data=1"], jax.devices()[:1])
    for args in (["mesh.data=2", "mesh.fsdp=4"], ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"]):
        losses, p8, specs = run(args, jax.devices())
        assert any("fsdp" in s for s in specs), specs
        np.testing.assert_allclose(losses, single, rtol=2e-6)
        worst = max(float(np.max(np.abs(a - b))) for a, b in zip(jax.tree.leaves(p8), jax.tree.leaves(p1)))
        assert worst < 2e-6, worst
        print("OK", args, losses, worst)
""")


def test_eight_device_data_fsdp_tensor_step_equals_single_device():
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=8"  # + the session's flags
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": flags}
    out = subprocess.run([sys.executable, "-c", _SCRIPT], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.count("OK") == 2


class _FakeMesh:
    shape = {"data": 2, "fsdp": 4, "tensor": 2}


@pytest.mark.parametrize("shape, names, expected", [
    ((64, 128), ("embed", "hidden"), P("fsdp", "tensor")),
    ((64, 64), ("embed", "embed"), P("fsdp", None)),  # an axis is used once per tensor
    ((97, 64), ("vocab", "embed"), P(None, "fsdp")),  # 97 is not divisible by tensor=2: replicated
    ((64,), (None,), P(None)),
])
def test_param_spec_rules(shape, names, expected):
    rules = {"embed": "fsdp", "hidden": "tensor", "vocab": "tensor"}
    assert mesh_lib.param_spec(shape, names, _FakeMesh(), rules) == expected


def test_logical_axes_name_dimensions_by_role():
    assert mesh_lib.logical_axes((1000, 64), d_model=64, vocab_size=1000) == ("vocab", "embed")
    assert mesh_lib.logical_axes((64, 256), d_model=64, vocab_size=1000) == ("embed", "hidden")
    assert mesh_lib.logical_axes((64,), d_model=64, vocab_size=1000) == (None,)
