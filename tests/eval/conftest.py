"""Fixtures of the language-model evaluation tests (tests/eval/test_{generate,perplexity,lm_eval}.py).

``tiny_run``: one run of configs/tiny.yaml (softmax, d=64, 2 layers, data.seq_len 64, the embedded corpus and
tokenizer) trained for 2 steps with a checkpoint after each, shared by the session. Tests that use it carry
``@pytest.mark.xdist_group("eval_tiny_run")`` so that ``make test`` (``--dist loadgroup``) trains it once.
"""
import os

# lm_eval's tasks load their local JSONL through HF datasets: never reach for the network.
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def pytest_configure(config):
    # pytest-xdist registers this marker; declare it too for runs without xdist (-p no:xdist, --strict-markers).
    config.addinivalue_line("markers", "xdist_group(name): keep these tests on one xdist worker (--dist loadgroup)")


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory) -> str:
    from mixerlab.training.config import load_config
    from mixerlab.training.loop import train

    out = tmp_path_factory.mktemp("eval_tiny_run") / "run"
    cfg = load_config(os.path.join(REPO_ROOT, "configs", "tiny.yaml"), [
        f"train.output_dir={out}", "train.steps=2", "checkpoint.every=1", "train.eval_every=0",
        "optim.warmup_steps=1", "train.log_every=1"])
    train(cfg, progress=False)
    return str(out)
