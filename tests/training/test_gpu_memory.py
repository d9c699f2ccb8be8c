"""train.gpu_memory_fraction: the share of GPU memory JAX's allocator gets, set before the devices are touched."""
from __future__ import annotations

from mixerlab.training import distributed
from mixerlab.training.config import load_config

ENV = distributed.GPU_MEMORY_ENV


def test_share_is_set_when_the_environment_has_none(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    assert distributed.gpu_memory_share(0.9) == "0.9"
    assert distributed.os.environ[ENV] == "0.9"


def test_the_environment_wins_and_null_keeps_jax_default(monkeypatch):
    monkeypatch.setenv(ENV, "0.5")
    assert distributed.gpu_memory_share(0.9) == "0.5"
    assert distributed.os.environ[ENV] == "0.5"
    monkeypatch.delenv(ENV)
    assert distributed.gpu_memory_share(None) is None
    assert ENV not in distributed.os.environ


def test_default_is_0_9_in_base_and_paper_configs():
    assert load_config("configs/base.yaml").train.gpu_memory_fraction == 0.9
    cfg = load_config("configs/paper/gdn2_166m.yaml")
    assert cfg.train.gpu_memory_fraction == 0.9


def test_train_cli_applies_the_share_before_training(monkeypatch, tmp_path, capsys):
    from mixerlab.training import cli, loop

    seen = []

    def fake_train(cfg):  # stands in for the run: records the share JAX would read, then stops the command
        seen.append(distributed.os.environ.get(ENV))
        raise RuntimeError("stop here")

    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.setattr(loop, "train", fake_train)
    rc = cli.main(["--config", "configs/tiny.yaml", "train.gpu_memory_fraction=0.85",
                   f"train.output_dir={tmp_path}"])
    assert rc == 1 and seen == ["0.85"]
    assert "stop here" in capsys.readouterr().err
