"""tools/plot_lm_budget.py: the sweep and long-run tables (seed means, spreads, epochs) and the band figure."""
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tools"))
sys.path.insert(0, os.path.dirname(__file__))
import plot_lm_budget  # noqa: E402
from test_lm_compare_report import _run  # noqa: E402


def test_tables_and_figure_from_a_budget_dir(tmp_path):
    (tmp_path / "sweep").mkdir()
    (tmp_path / "long").mkdir()
    for lr, loss in (("3e-4", 4.7), ("6e-4", 4.5), ("1e-3", 4.6)):
        _run(tmp_path / "sweep", f"transformer_lr{lr}", "softmax", [(500, loss)], 500, 500)
    _run(tmp_path / "long", "transformer_s0", "softmax", [(250, 4.2), (500, 3.9)], 500, 500)
    _run(tmp_path / "long", "transformer_s1", "softmax", [(250, 4.3), (500, 3.8)], 500, 500)
    _run(tmp_path / "long", "gdn2_s0", "gdn2", [(250, 3.7), (500, 3.5)], 500, 500)
    out = tmp_path / "report"
    assert plot_lm_budget.main([str(tmp_path), "--train_tokens", "8192000", "--out", str(out)]) == 0
    text = (out / "budget.md").read_text()
    assert "| transformer | 0.0003 → 4.7000, 0.0006 → 4.5000, 0.001 → 4.6000 | 0.0006 |" in text
    rows = [line for line in text.split("## Long runs")[1].splitlines() if line.startswith("| ") and "---" not in line]
    # best mean first; 500 steps × 16 × 2048 tokens = 16.4M = 2 epochs of 8.192M
    assert rows[1].startswith("| gdn2 |")
    assert "| 500 / 500 | 3.5000 | 500 | 3.5000 | nan | 16.4M | 2.00 | 3.5000 |" in rows[1]
    assert rows[2].startswith("| transformer |") and "| 3.9000, 3.8000 | 500 | 3.8500 | 0.1000 |" in rows[2]
    assert (out / "budget.png").stat().st_size > 1000


def test_runs_cut_at_different_steps_compare_where_all_arrived(tmp_path):
    (tmp_path / "long").mkdir()
    _run(tmp_path / "long", "transformer_s0", "softmax", [(250, 4.2), (500, 3.9), (750, 3.0)], 750, 1000)
    _run(tmp_path / "long", "transformer_s1", "softmax", [(250, 4.4), (500, 3.7)], 600, 1000)
    _run(tmp_path / "long", "gdn2_s0", "gdn2", [(250, 4.0)], 300, 1000)
    text = plot_lm_budget.long_table(plot_lm_budget.long_runs([str(tmp_path)]), 8192000)
    assert "mean at step 250 (all models)" in text
    rows = [line for line in text.splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert rows[0].startswith("| gdn2 |") and rows[0].endswith("| 4.0000 |")  # 4.0 < (4.2 + 4.4) / 2 at step 250
    assert "| 750, 600 / 1000 | 3.9000, 3.7000 | 500 | 3.8000 | 0.2000 |" in rows[1]


def test_refuses_a_directory_that_is_not_a_budget_run(tmp_path, capsys):
    assert plot_lm_budget.main([str(tmp_path), "--train_tokens", "1e6", "--out", str(tmp_path / "o")]) == 2
    assert "neither sweep/ nor long/" in capsys.readouterr().err


def _evaluation(run_dir, loss, bpb, nll_by_mult, buckets):
    (run_dir / "eval").mkdir(parents=True)
    ext = {"seq_len": 2048, "bucket_tokens": 512, "documents": 3, "bucket_start": [0, 512, 1024],
           "nll_full_context": buckets,
           "lengths": [{"multiplier": m, "length": int(2048 * m), "nll": v} for m, v in nll_by_mult.items()]}
    (run_dir / "eval" / "perplexity.json").write_text(json.dumps(
        {"step": 500, "validation": {"loss": loss, "bits_per_byte": bpb, "documents": 200},
         "length_extrapolation": ext}))


def test_evaluations_of_the_final_checkpoints_go_into_the_table_and_figure(tmp_path):
    (tmp_path / "long").mkdir()
    _run(tmp_path / "long", "transformer_s0", "softmax", [(250, 4.2), (500, 3.9)], 500, 500)
    _run(tmp_path / "long", "transformer_s1", "softmax", [(250, 4.3), (500, 3.8)], 500, 500)
    _run(tmp_path / "long", "gdn2_s0", "gdn2", [(250, 3.7), (500, 3.5)], 500, 500)
    _evaluation(tmp_path / "long" / "transformer_s0", 2.0, 0.8, {1.0: 2.1, 3.5: 3.0}, [2.2, 2.0, 3.0])
    _evaluation(tmp_path / "long" / "transformer_s1", 2.2, 0.9, {1.0: 2.3, 3.5: 3.4}, [2.4, 2.2, 3.4])
    evals = plot_lm_budget.evaluations([str(tmp_path)])
    assert list(evals) == ["transformer"] and [e["seed"] for e in evals["transformer"]] == [0, 1]
    text = plot_lm_budget.eval_table(evals)
    # mean ± half the range of the two seeds; the model without an evaluation is not listed
    assert ("| transformer | 0, 1 | 500 | 200 | 2.1000 ± 0.1000 | 0.8500 ± 0.0500 | 2.2000 ± 0.1000 | "
            "3.2000 ± 0.2000 |") in text
    assert "loss at 3.5x context" in text and "gdn2" not in text
    out = tmp_path / "report"
    assert plot_lm_budget.main([str(tmp_path), "--train_tokens", "8192000", "--out", str(out)]) == 0
    assert "## Evaluation of the final checkpoints" in (out / "budget.md").read_text()
    assert (out / "budget.png").stat().st_size > 1000
