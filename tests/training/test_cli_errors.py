"""Every console script of pyproject's [project.scripts]: a wrong or missing input is one line on stderr that
names the argument, exit code 2; a runtime failure is one line, exit code 1 (training/cli_errors.py)."""
import importlib
import os
import subprocess
import sys
import tomllib

import pytest

from mixerlab.training import cli_errors
from mixerlab.training.cli_errors import UsageError, entry_point, exit_code, naming

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _scripts() -> dict:
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)["project"]["scripts"]


def _main(script):
    module, func = _scripts()[script].split(":")
    return getattr(importlib.import_module(module), func)


# A bad input for each script and the words its one line must hold (a new script adds its row here).
BAD_INPUT = {
    "mixerlab-train": (lambda t: ["--config", str(t / "nope.yaml")], ["--config", "nope.yaml", "no such file"]),
    "mixerlab-eval": (lambda t: ["--run", str(t / "nope")], ["--run", "no such directory"]),
    "mixerlab-generate": (lambda t: ["--run", str(t / "nope"), "--prompt", "hi"], ["--run", "no such directory"]),
    "mixerlab-prepare-data": (lambda t: ["--source", str(t / "nope.jsonl"), "--out", str(t / "out")],
                              ["--source", "does not exist"]),
    "mixerlab-train-tokenizer": (lambda t: ["--corpus", str(t / "nope.jsonl"), "--out", str(t / "tok.json"),
                                            "--vocab_size", "300"], ["--corpus", "does not exist"]),
    # checkpoint interop (interop), where the package has it: positional RUN / HF_DIR
    "mixerlab-export": (lambda t: [str(t / "nope"), str(t / "hf")], ["nope"]),
    "mixerlab-import": (lambda t: [str(t / "nope"), str(t / "run")], ["nope"]),
}


def test_every_console_script_has_a_bad_input_case():
    assert set(_scripts()) <= set(BAD_INPUT), sorted(set(_scripts()) - set(BAD_INPUT))


@pytest.mark.parametrize("script", sorted(_scripts()))
def test_a_bad_input_is_one_line_naming_the_argument_with_exit_code_2(script, tmp_path, capsys):
    args, words = BAD_INPUT[script]
    code = _main(script)(args(tmp_path))
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert code == 2 and len(lines) == 1, captured.err
    assert "Traceback" not in captured.err and all(w in lines[0] for w in words), lines[0]


def test_mixerlab_eval_in_a_process_prints_one_line(tmp_path):
    """The reported case: `mixerlab-eval --run <missing>` printed a traceback and exited 1."""
    out = subprocess.run([sys.executable, "-m", "mixerlab.eval.perplexity", "--run", str(tmp_path / "nope")],
                         capture_output=True, text=True, timeout=120, cwd=REPO)
    assert out.returncode == 2, out.stderr[-2000:]
    assert out.stderr.strip().splitlines() == [
        f"mixerlab-eval: error: --run {tmp_path / 'nope'}: run path '{tmp_path / 'nope'}': no such directory "
        "(expected a run directory with config.yaml and checkpoints/, or its checkpoints/ directory)"]


def test_a_missing_checkpoint_step_names_run_and_step(tmp_path, capsys, monkeypatch):
    from mixerlab.eval import checkpoint, perplexity

    def refuse(run, step):
        raise ValueError(f"checkpoint step {step} is not in '{run}/checkpoints'; available steps: 5, 10")

    monkeypatch.setattr(checkpoint, "load_run", refuse)
    assert perplexity.main(["--run", str(tmp_path), "--step", "3"]) == 2
    assert capsys.readouterr().err.strip() == (f"mixerlab-eval: error: --run {tmp_path} --step 3: checkpoint step 3 "
                                               f"is not in '{tmp_path}/checkpoints'; available steps: 5, 10")


def test_a_runtime_failure_is_one_line_with_exit_code_1(tmp_path, capsys, monkeypatch):
    from mixerlab.eval import perplexity

    def fail(args):
        raise RuntimeError("INTERNAL: the device went away\n  long library detail\n  more")

    monkeypatch.setattr(perplexity, "evaluate_run", fail)
    assert perplexity.main(["--run", str(tmp_path)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"mixerlab-eval: error: RuntimeError: INTERNAL: the device went away (set "
                   f"{cli_errors.TRACEBACK_ENV}=1 for the traceback)"]
    monkeypatch.setenv(cli_errors.TRACEBACK_ENV, "1")
    with pytest.raises(RuntimeError, match="device went away"):
        perplexity.main(["--run", str(tmp_path)])


def test_exit_codes_and_naming():
    def library_value_error():
        return int("x")  # raised inside Python, not by mixerlab's checks: a runtime failure

    with pytest.raises(ValueError) as err:
        library_value_error()
    assert exit_code(err.value) == 1
    with pytest.raises(ValueError) as err:
        from mixerlab.training.config import load_config

        load_config(None, ["model.d_model=-1"])
    assert exit_code(err.value) == 2  # a ConfigError
    assert exit_code(FileNotFoundError("x")) == 2 and exit_code(UsageError("x")) == 2
    assert exit_code(RuntimeError("x")) == 1 and exit_code(MemoryError()) == 1
    with pytest.raises(UsageError, match=r"^--out: 'x' is a file"):
        with naming("--out"):
            raise NotADirectoryError("'x' is a file")
    with pytest.raises(UsageError, match=r"^--run: already named"):
        with naming("--run"):
            raise ValueError("--run: already named")
    with pytest.raises(RuntimeError):
        with naming("--run"):
            raise RuntimeError("not the user's")


def test_interrupt_and_argparse_errors_keep_their_codes(capsys):
    @entry_point("mixerlab-x")
    def main(argv=None):
        if argv == ["--bad"]:
            raise SystemExit(2)  # argparse's own usage error
        raise KeyboardInterrupt

    with pytest.raises(SystemExit) as ended:
        main(["--bad"])
    assert ended.value.code == 2
    assert main([]) == 130 and capsys.readouterr().err.strip() == "mixerlab-x: interrupted"
