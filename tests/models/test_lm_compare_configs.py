"""configs/lm_compare: every model loads, and the parameter counts are matched as the configs' comment says."""
import functools
import glob
import os

import pytest

from mixerlab.models.decoder import abstract_model
from mixerlab.models.param_count import count_params
from mixerlab.training.config import load_config

VOCAB = 16384  # the corpus tokenizer's vocabulary (docs/lm_corpus.md)
CONFIGS = sorted(p for p in glob.glob("configs/lm_compare/*.yaml") if not os.path.basename(p).startswith("_"))


def test_every_model_is_there():
    names = [os.path.basename(p)[:-5] for p in CONFIGS]
    assert names == ["gdn2", "gla", "hgrn2", "interdomain", "mamba2", "muir", "muir_no_gamma", "muir_static_gamma",
                     "retnet", "rwkv7", "s4d", "transformer", "transformer_conv"]


@functools.cache
def matrices(path):
    return count_params(abstract_model(load_config(path, [f"model.vocab_size={VOCAB}"]), VOCAB))["matrices"]


@pytest.mark.parametrize("path", CONFIGS)
def test_matrix_parameters_match_the_transformer_within_half_a_percent(path):
    ours, reference = matrices(path), matrices("configs/lm_compare/transformer.yaml")
    assert abs(ours / reference - 1) < 0.005, (path, ours, reference)
    assert 41e6 < ours < 43e6
