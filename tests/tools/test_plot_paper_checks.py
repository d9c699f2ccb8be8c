"""tools/plot_paper_checks.py: the long-context, copy and Table 7 summaries from results.json files."""
import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tools"))
import plot_paper_checks  # noqa: E402


def _job(root, name, runs):
    (root / name).mkdir()
    (root / name / "results.json").write_text(json.dumps({"results": runs}))


def _run(mixer, acc, seed=42, kind="mqar", history=(), lags=None):
    return {"mixer": mixer, "accuracy": acc, "seed": seed, "steps": 1500, "final_loss": 1.0 - acc,
            "task": {"kind": kind}, "history": list(history), "held_out": lags or {}}


def test_long_context_table_is_mixer_by_length(tmp_path, capsys):
    _job(tmp_path, "a", [_run("vla, T = 64", 1.0), _run("vla, T = 512", 0.125)])
    _job(tmp_path, "b", [_run("softmax, T = 64", 0.2)])
    _job(tmp_path, "merged", [_run("ignored, T = 64", 0.5)])  # a merged directory repeats runs
    (tmp_path / "merged" / "results.json").write_text(json.dumps({"merged_from": ["x"], "results": []}))
    assert plot_paper_checks.main(["longctx", str(tmp_path), "--out", str(tmp_path / "f.png")]) == 0
    out = capsys.readouterr().out
    assert "| vla | 1.000 | 0.125 |" in out and "| softmax | 0.200 | – |" in out and "ignored" not in out
    assert (tmp_path / "f.png").stat().st_size > 1000


def test_copy_reports_step_150_and_final(tmp_path, capsys):
    hist = [{"step": 150, "loss": 2.0}, {"step": 150, "accuracy": 0.11}, {"step": 1500, "accuracy": 0.73}]
    _job(tmp_path, "copy_vla", [_run("vla", 0.73, kind="copy", history=hist)])
    _job(tmp_path, "mqar", [_run("vla", 1.0)])  # not a copy run: left out
    assert plot_paper_checks.main(["copy", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "| vla | 0.110 | 0.730 (1500) | 0.270 |" in out and out.count("| vla |") == 1


def test_table7_mean_and_sample_std_over_seeds_per_lag(tmp_path, capsys):
    lags = [{"lag_8_32": a, "lag_32_128": a, "lag_128_256": a} for a in (0.5, 1.0)]
    _job(tmp_path, "a", [_run("GDN-2", 0.5, seed=0, lags=lags[0])])
    _job(tmp_path, "b", [_run("GDN-2", 1.0, seed=1, lags=lags[1])])
    assert plot_paper_checks.main(["table7", str(tmp_path), "--out", str(tmp_path / "t.png")]) == 0
    out = capsys.readouterr().out
    assert "| GDN-2 | 0,1 | 0.750 ± 0.354 | 0.750 ± 0.354 |" in out


def test_bad_inputs_name_the_problem(tmp_path):
    with pytest.raises(SystemExit, match="no results.json"):
        plot_paper_checks.main(["copy", str(tmp_path)])
    _job(tmp_path, "a", [_run("vla", 1.0)])
    with pytest.raises(SystemExit, match="not 'MIXER, T = N'"):
        plot_paper_checks.longctx(plot_paper_checks.load(str(tmp_path)), None)
