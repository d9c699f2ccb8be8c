"""tools/lm_pick_lr.py: each model's LR from a sweep; unfinished and diverged runs never win; edges are marked."""
import os
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tools"))
sys.path.insert(0, os.path.dirname(__file__))
import lm_pick_lr  # noqa: E402
from test_lm_compare_report import _run  # noqa: E402

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")


def test_the_lowest_finished_loss_wins_per_model(tmp_path, capsys):
    _run(tmp_path, "gdn2_lr7.5e-4", "gdn2", [(500, 3.9)], 500, 500)
    _run(tmp_path, "gdn2_lr1.5e-3", "gdn2", [(500, 3.8)], 500, 500)
    _run(tmp_path, "gdn2_lr3e-3", "gdn2", [(400, 3.5)], 450, 500)  # cut short: lower, but does not compete
    _run(tmp_path, "transformer_lr3e-4", "softmax", [(500, 4.7)], 500, 500)
    _run(tmp_path, "transformer_lr6e-4", "softmax", [(500, 4.6)], 500, 500)
    _run(tmp_path, "transformer_lr1e-3", "softmax", [(500, 4.5)], 500, 500)
    _run(tmp_path, "transformer_lr2e-3", "softmax", [(500, float("nan"))], 500, 500)  # diverged
    assert lm_pick_lr.main([str(tmp_path)]) == 0
    out = capsys.readouterr()
    assert out.out.split("\n")[:2] == ["gdn2 0.0015", "transformer 0.001"]
    table = (tmp_path / "lr_choice.md").read_text()
    assert "| gdn2 | 0.00075 → 3.9000, 0.0015 → 3.8000, 0.003 → – | 0.0015 |" in table
    assert "| transformer | 0.0003 → 4.7000, 0.0006 → 4.6000, 0.001 → 4.5000, 0.002 → – | 0.001 |" in table


def test_a_winner_at_the_grid_edge_is_marked(tmp_path):
    for lr, loss in (("1e-3", 4.0), ("2e-3", 4.1), ("4e-3", 4.2)):
        _run(tmp_path, f"gdn2_lr{lr}", "gdn2", [(500, loss)], 500, 500)
    choice = lm_pick_lr.pick(lm_pick_lr.load_dir(str(tmp_path)))
    assert choice["gdn2"]["lr"] == 1e-3 and choice["gdn2"]["edge"]
    assert "0.001 (grid edge)" in lm_pick_lr.table(choice)


def test_extend_steps_past_the_winning_end_by_the_grid_ratio(tmp_path, capsys):
    for lr, loss in (("7.5e-4", 3.8), ("1.5e-3", 3.6), ("3e-3", 3.5)):  # top end wins
        _run(tmp_path, f"gdn2_lr{lr}", "gdn2", [(500, loss)], 500, 500)
    for lr, loss in (("3e-4", 4.2), ("6e-4", 4.3), ("1e-3", 4.4)):  # bottom end wins
        _run(tmp_path, f"transformer_lr{lr}", "softmax", [(500, loss)], 500, 500)
    for lr, loss in (("1e-3", 4.0), ("2e-3", 3.9), ("4e-3", 4.1)):  # inside: nothing to add
        _run(tmp_path, f"muir_lr{lr}", "muir", [(500, loss)], 500, 500)
    assert lm_pick_lr.main([str(tmp_path), "--extend"]) == 0
    assert capsys.readouterr().out.split() == ["gdn2", "0.006", "transformer", "0.00015"]


def test_a_model_with_no_finished_run_fails_by_name(tmp_path, capsys):
    _run(tmp_path, "muir_lr1e-3", "muir", [(100, 5.0)], 100, 500)
    _run(tmp_path, "gdn2_lr1e-3", "gdn2", [(500, 4.0)], 500, 500)
    assert lm_pick_lr.main([str(tmp_path)]) == 1
    out = capsys.readouterr()
    assert out.out.strip() == "gdn2 0.001" and "no finished sweep run for muir" in out.err


def test_the_pipeline_refuses_bad_models_before_starting(tmp_path):
    script = os.path.join(ROOT, "tools", "gpu_lm_budget.sh")
    for models, says in (("nosuch=1e-3/2e-3/3e-3", "no configs/lm_compare/nosuch.yaml"),
                         ("gdn2=1e-3/2e-3", "at least 3 LRs")):
        r = subprocess.run(["bash", script, "start", str(tmp_path / "x"), models, "1"], cwd=ROOT,
                           capture_output=True, text=True)
        assert r.returncode == 2 and says in r.stderr, r.stderr
        assert not (tmp_path / "x").exists()
    # long runs asked for a model that is not swept ("gdn" is a prefix of "gdn2", not one of the models)
    r = subprocess.run(["bash", script, "start", str(tmp_path / "x"), "gdn2=1e-3/2e-3/3e-3,muir=1e-3/2e-3/3e-3", "1"],
                       cwd=ROOT, capture_output=True, text=True, env={**os.environ, "LONG_MODELS": "muir,gdn"})
    assert r.returncode == 2 and "LONG_MODELS: 'gdn' is not one of MODELS" in r.stderr, r.stderr
    assert not (tmp_path / "x").exists()
    r = subprocess.run(["bash", script, "wait", str(tmp_path / "y")], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 2 and "no pipeline was started there" in r.stderr


def test_long_models_gives_long_runs_to_those_models_only(tmp_path):
    """The pipeline with a stand-in for gpu_lm_compare.sh that logs what it was asked to run."""
    tools = tmp_path / "repo" / "tools"
    tools.mkdir(parents=True)
    for name in ("gpu_lm_budget.sh", "lm_pick_lr.py", "lm_compare_report.py"):
        (tools / name).write_text(open(os.path.join(ROOT, "tools", name)).read())
    (tools / "gpu_lm_compare.sh").write_text('echo "$@" >> "$(dirname "$1")/asked.txt"\n')
    (tmp_path / "old").mkdir()
    for lr, loss in (("1e-3", 4.0), ("2e-3", 3.9), ("4e-3", 4.1)):
        _run(tmp_path / "old", f"muir_lr{lr}", "muir", [(500, loss)], 500, 500)
        _run(tmp_path / "old", f"gdn2_lr{lr}", "gdn2", [(500, loss - 0.1)], 500, 500)
    out = tmp_path / "repo" / "runs" / "b"
    out.mkdir(parents=True)
    env = {**os.environ, "LONG_MODELS": "muir", "SWEEP_FROM": str(tmp_path / "old"), "EXTEND_ROUNDS": "0"}
    models = "muir=1e-3/2e-3/4e-3,gdn2=1e-3/2e-3/4e-3"
    r = subprocess.run(["bash", "tools/gpu_lm_budget.sh", "pipeline", "runs/b", models],
                       cwd=tmp_path / "repo", capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr
    assert (out / "lr.txt").read_text().split() == ["gdn2", "0.002", "muir", "0.002"]
    asked = (out / "asked.txt").read_text().split("\n")[0].split()
    muir_only = "muir_s0:muir:optim.lr=0.002:train.seed=0,muir_s1:muir:optim.lr=0.002:train.seed=1"
    assert asked[:2] == ["runs/b/long", muir_only]
    assert "gdn2 (LR 0.002) left for later" in r.stdout and (out / "done").read_text().strip() == "0"
