"""tools/lm_compare_report.py: the LM-comparison table from run directories, a run cut mid-write included."""
import json
import os
import sys

import yaml

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tools"))
import lm_compare_report  # noqa: E402


def _run(root, name, mixer, val_losses, steps, planned, partial_line=False):
    d = root / name
    d.mkdir()
    with open(d / "config.yaml", "w") as f:
        yaml.safe_dump({"model": {"mixer": mixer}, "data": {"seq_len": 2048},
                        "train": {"batch_size": 16, "steps": planned}}, f)
    with open(d / "metrics.jsonl", "w") as f:
        for s in range(10, steps + 1, 10):
            f.write(json.dumps({"step": s, "split": "train", "loss": 9.0 - s / 100, "tokens_per_s": 1000.0 * s}) + "\n")
        for s, v in val_losses:
            f.write(json.dumps({"step": s, "split": "val", "loss": v, "perplexity": 2.718281828 ** v}) + "\n")
        if partial_line:
            f.write('{"step": 99, "split": "tr')


def test_table_orders_by_final_val_loss_and_marks_a_cut_run(tmp_path):
    _run(tmp_path, "gdn2", "gdn2", [(100, 5.0), (200, 4.5)], 200, 200)
    _run(tmp_path, "transformer", "softmax", [(100, 4.9), (200, 4.2)], 200, 200)
    _run(tmp_path, "interdomain", "interdomain", [(100, 5.5)], 130, 200, partial_line=True)
    assert lm_compare_report.main([str(tmp_path), "--out", str(tmp_path / "report")]) == 0
    text = (tmp_path / "report" / "table.md").read_text()
    rows = [line for line in text.splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert [r.split("|")[1].strip() for r in rows] == ["transformer", "gdn2", "interdomain"]
    assert "| 130 / 200 | 4.3M | 5.5000 (100) |" in rows[2]  # 130 steps × 16 × 2048 tokens, last val at 100
    assert "| 200 / 200 | 6.6M | 4.2000 (200) |" in rows[0]
    assert (tmp_path / "report" / "val_loss.png").stat().st_size > 1000


def test_no_runs_is_an_error_naming_the_directory(tmp_path, capsys):
    assert lm_compare_report.main([str(tmp_path)]) == 2
    assert str(tmp_path) in capsys.readouterr().err


def test_a_run_known_only_from_its_terminal_log(tmp_path):
    """The progress bar repeats a postfix on every refresh; the loss of step 20 is the one its last refresh at
    position 20 shows, and positions between logging steps are not rows."""
    bar = ("train:   4%|▍| 20/500 [01:47<04:05, loss=8.365, mfu=0.1%, tok_s=3,133]"
           "train:   4%|▍| 20/500 [01:47<04:05, loss=6.249, mfu=2.7%, tok_s=96,862]"
           "train:   4%|▍| 21/500 [01:47<04:29, loss=6.249, mfu=2.7%, tok_s=96,862]"
           "train:   6%|▌| 30/500 [01:50<02:18, loss=6.632, mfu=3.1%, tok_s=110,007]"
           "   step 30: validation loss 5.1202, perplexity 167.36\n")
    (tmp_path / "gdn2.log").write_text(bar)
    run = lm_compare_report.load_log(str(tmp_path / "gdn2.log"), "configs/lm_compare/gdn2.yaml")
    assert [(r["step"], r["loss"]) for r in run["train"]] == [(20, 6.249), (30, 6.632)]
    assert run["val"] == [{"step": 30, "split": "val", "loss": 5.1202, "perplexity": 167.36}]
    assert lm_compare_report.main([str(tmp_path)]) == 0
    assert "| gdn2 | gdn2 | 30 / 500 | 1.0M | 5.1202 (30) |" in (tmp_path / "table.md").read_text()


def test_several_run_directories_one_table_with_labelled_runs(tmp_path, capsys):
    for seed, loss in (("s0", 4.5), ("s1", 4.4)):
        (tmp_path / seed).mkdir()
        _run(tmp_path / seed, "gdn2", "gdn2", [(100, loss)], 100, 100)
    dirs = [str(tmp_path / "s0"), str(tmp_path / "s1")]
    assert lm_compare_report.main(dirs) == 2  # several directories need --out
    assert "--out is required" in capsys.readouterr().err
    assert lm_compare_report.main(dirs + ["--labels", "a"]) == 2
    assert lm_compare_report.main(dirs + ["--labels", "seed 0,seed 1", "--out", str(tmp_path / "r")]) == 0
    text = (tmp_path / "r" / "table.md").read_text()
    rows = [line.split("|")[1].strip() for line in text.splitlines() if line.startswith("| ") and "---" not in line]
    assert rows[1:] == ["seed 1/gdn2", "seed 0/gdn2"]
