"""training/config_files.py: --config names a file on disk or a config shipped in the package."""
from __future__ import annotations

import os

import pytest

from mixerlab.training import cli
from mixerlab.training.config import ConfigError
from mixerlab.training.config_files import PACKAGED_CONFIGS, packaged_config_names, resolve_config_path

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_the_packaged_configs_are_the_repository_configs():
    assert os.path.samefile(PACKAGED_CONFIGS, os.path.join(ROOT, "configs"))


@pytest.mark.parametrize("name, expected", [
    ("base", "base.yaml"),
    ("paper/muir_166m", "paper/muir_166m.yaml"),
    ("paper/muir_166m.yaml", "paper/muir_166m.yaml"),
    ("configs/tiny.yaml", "tiny.yaml"),  # the checkout's path, from a folder that has no configs/
])
def test_a_name_that_is_no_file_here_is_a_packaged_config(tmp_path, monkeypatch, name, expected):
    monkeypatch.chdir(tmp_path)
    assert resolve_config_path(name) == os.path.join(PACKAGED_CONFIGS, expected)


def test_an_existing_file_wins_over_a_packaged_config(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "base").write_text("model: {num_layers: 1}\n")
    os.makedirs(tmp_path / "configs")
    (tmp_path / "configs" / "tiny.yaml").write_text("model: {num_layers: 1}\n")
    assert resolve_config_path("base") == "base"
    assert resolve_config_path("configs/tiny.yaml") == "configs/tiny.yaml"


@pytest.mark.parametrize("name", ["no_such_config", "../configs/base", "/nowhere/base.yaml"])
def test_an_unknown_name_is_one_line_naming_where_it_looked_and_valid_names(tmp_path, monkeypatch, name):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as e:
        resolve_config_path(name)
    message = str(e.value)
    assert "\n" not in message and repr(name) in message and PACKAGED_CONFIGS in message
    assert "base, tiny" in message and "in all)" in message


def test_packaged_names_leave_out_shared_parents():
    names = packaged_config_names()
    assert names[:2] == ["base", "tiny"] and "paper/muir_166m" in names
    assert not [n for n in names if os.path.basename(n).startswith("_")]


def test_cli_runs_a_packaged_config_and_its_inherit_chain_from_another_folder(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert cli.main(["--config", "paper/muir_166m", "--print_config"]) == 0
    assert "mixer: muir" in capsys.readouterr().out  # paper/muir_166m -> _muir_common -> ../base, all packaged
    assert cli.main(["--config", "paper/nope", "--print_config"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("config error: --config 'paper/nope'") and err.count("\n") == 1
