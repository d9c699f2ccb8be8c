"""tools/plot_lm_gap.py: runs grouped by what their configs say (mixer, short convolution, SiLU), table and figure."""
import json
import os
import sys

import pytest
import yaml

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "tools"))

import plot_lm_gap  # noqa: E402


def _run(root, call, name, mixer, options, lr, seed, losses):
    folder = root / call / name
    folder.mkdir(parents=True)
    cfg = {"model": {"mixer": mixer}, "mixers": {mixer: options}, "optim": {"lr": lr}, "train": {"seed": seed,
           "batch_size": 2}, "data": {"seq_len": 8}}
    (folder / "config.yaml").write_text(yaml.safe_dump(cfg))
    rows = [{"split": "train", "step": 1, "loss": 9.0}] + [
        {"split": "val", "step": 100 * (i + 1), "loss": v} for i, v in enumerate(losses)]
    (folder / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")


def test_groups_runs_by_config_and_writes_the_figure(tmp_path, capsys):
    _run(tmp_path, "a", "t", "softmax", {}, 1.5e-3, 0, [5.0, 4.6])
    _run(tmp_path, "a", "tc", "softmax", {"use_short_conv": True}, 1.5e-3, 0, [4.9, 3.9])
    _run(tmp_path, "b", "tcs", "softmax", {"use_short_conv": True, "conv_activation": True}, 1e-3, 1, [5.1, 4.0])
    _run(tmp_path, "b", "g", "gdn2", {"use_short_conv": False}, 1.5e-3, 1, [4.8, 3.9])
    _run(tmp_path, "b", "g2", "gdn2", {}, 1.5e-3, 0, [4.7, 3.8])
    assert plot_lm_gap.main([str(tmp_path), "--out", str(tmp_path / "f.png")]) == 0
    table = capsys.readouterr().out
    assert "| a/t | Transformer | 0.0015 | 0 | 4.6000 |" in table
    assert "| a/tc | Transformer + short conv | 0.0015 | 0 | 3.9000 |" in table
    assert "| b/tcs | Transformer + short conv (SiLU) | 0.001 | 1 | 4.0000 |" in table
    assert "| b/g | GDN-2 without short convs |" in table and "| b/g2 | GDN-2 | 0.0015 | 0 | 3.8000 |" in table
    assert os.path.getsize(tmp_path / "f.png") > 0
    runs = plot_lm_gap.load(str(tmp_path))
    assert [t for t, _ in runs[0]["val"]] == [1600, 3200]  # steps × 2 rows × 8 tokens


def test_an_empty_folder_is_refused(tmp_path):
    with pytest.raises(SystemExit, match="no \\*/\\*/metrics.jsonl"):
        plot_lm_gap.main([str(tmp_path)])
