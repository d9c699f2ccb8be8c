"""tools/bench_latency_vs_length.py: the crossover T against attention, the table, option errors."""
import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tools"))
import bench_latency_vs_length as bench  # noqa: E402


def test_crossover_interpolates_in_log_log_and_names_the_edge_cases():
    attention = {1024: 1.0, 4096: 16.0}  # quadratic
    linear = {1024: 4.0, 4096: 4.0}
    # log ratios: log 4 at 1024, log(1/4) at 4096 -> halfway in log T: T = 2048
    assert bench.crossover(linear, attention) == pytest.approx(2048.0)
    assert bench.crossover({1024: 0.5, 4096: 1.0}, attention) == "below throughout"
    assert bench.crossover({1024: 8.0, 4096: 64.0}, attention) is None
    assert bench.crossover({1024: "RuntimeError: x"}, attention) is None  # a failed cell is not a time


def test_markdown_marks_missing_and_failed_cells():
    results = {"vla/xla": {16: 2.0, 32: "ValueError: too long"}, "attention": {16: 1.0, 32: 4.0}}
    text = bench.markdown(results, (16, 32, 64))
    assert "| vla/xla | 2.000 | error | – | none in range |" in text
    assert "| attention | 1.000 | 4.000 | – | – |" in text


def test_unknown_ops_and_bad_lengths_are_refused(capsys):
    with pytest.raises(SystemExit):
        bench.main(["--smoke", "--out", "/tmp/x.json", "--ops", "flash"])
    assert "--ops: unknown ['flash']" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.main(["--smoke", "--out", "/tmp/x.json", "--lengths", "1k"])
    assert "--lengths must be comma-separated integers" in capsys.readouterr().err


def test_from_logs_merges_cells_later_log_wins_and_times_nothing(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(bench, "measure", lambda *a, **k: pytest.fail("--from_logs must not time anything"))
    first = tmp_path / "a.log"
    first.write_text('{"op": "attention", "T": 16, "ms": 1.0}\nsome compiler warning\n'
                     '{"op": "vla/xla", "T": 16, "ms": 9.0}\n')
    second = tmp_path / "b.log"
    second.write_text('{"op": "vla/xla", "T": 16, "ms": 3.0}\n{"op": "vla/xla", "T": 32, "ms": 5.0}\n'
                      '{"op": "attention", "T": 32, "ms": 6.0}\n')
    out = tmp_path / "m.json"
    assert bench.main(["--from_logs", str(first), str(second), "--device", "H200", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "| vla/xla | 3.000 | 5.000 | T ≈ 29 |" in text  # log ratios log 3, log(5/6): 16·2^0.858
    payload = json.loads(out.read_text())
    assert payload["device"] == "H200" and payload["backend"] is None
    assert payload["results"]["vla/xla"] == {"16": 3.0, "32": 5.0}


def test_from_logs_keeps_the_requested_pass(tmp_path, capsys):
    log = tmp_path / "a.log"
    log.write_text('{"op": "attention", "T": 16, "ms": 1.0}\n'
                   '{"op": "attention", "T": 16, "ms": 3.0, "pass": "forward+backward"}\n'
                   '{"op": "attention", "T": 16, "ms": 2.0, "pass": "forward"}\n')
    out = tmp_path / "m.json"
    assert bench.main(["--from_logs", str(log), "--out", str(out)]) == 0
    assert json.loads(out.read_text())["results"]["attention"] == {"16": 2.0}
    assert bench.main(["--from_logs", str(log), "--grad", "--out", str(out)]) == 0
    payload = json.loads(out.read_text())
    assert payload["results"]["attention"] == {"16": 3.0} and payload["timed"] == "forward+backward"
    capsys.readouterr()


def test_grad_smoke_times_forward_and_backward_on_cpu(tmp_path, capsys):
    """--grad on CPU at tiny sizes: every cell is a time (the backward of the toeplitz form and attention run)."""
    out = tmp_path / "g.json"
    assert bench.main(["--smoke", "--grad", "--ops", "interdomain/toeplitz,attention", "--out", str(out)]) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines() if x.startswith("{")]
    assert {x["pass"] for x in lines} == {"forward+backward"} and len(lines) == 4
    payload = json.loads(out.read_text())
    assert all(isinstance(ms, float) for row in payload["results"].values() for ms in row.values())
