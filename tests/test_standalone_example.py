"""examples/standalone_mixer.py (docs/use_a_mixer.md): a registry mixer inside a user's own nnx.Module trains."""
from __future__ import annotations

import importlib.util
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "standalone_mixer.py")


def _load_example():
    spec = importlib.util.spec_from_file_location("standalone_mixer_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("mixer", ["softmax"])
def test_example_builds_a_registry_mixer_in_a_user_model_and_trains_it(mixer, capsys):
    example = _load_example()
    assert example.main(["--mixer", mixer, "--steps", "2"]) == 0
    out = capsys.readouterr().out
    assert f"{mixer}: logits (2, 33, 256) float32" in out, out
    first, last = (float(x) for x in out.split("losses ")[1].split(",")[0].split(" -> "))
    assert last < first, out


def test_example_notices_a_model_that_is_not_causal(monkeypatch, capsys):
    # The causality check must be able to fail: let the readout see the whole row (a mean over time).
    example = _load_example()
    call = example.TinyLM.__call__

    def leaky(self, tokens_BT):
        logits = call(self, tokens_BT)
        return logits + logits.mean(axis=1, keepdims=True)

    monkeypatch.setattr(example.TinyLM, "__call__", leaky)
    assert example.main(["--mixer", "softmax", "--steps", "1"]) == 1
    assert "is not causal" in capsys.readouterr().out
