"""Dispatch (fail-closed choice, one log line per rejected candidate) and argument validation."""
from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import pytest

from mixerlab.pallas_kernels import delta_rule, delta_rule_step, dispatch, normalized_linear_attention
from mixerlab.pallas_kernels.delta_rule import api

B, T, H, DK, DV = 1, 10, 2, 4, 3


def _inputs(**overrides):
    key = jax.random.PRNGKey(0)
    kq, kk, kv = jax.random.split(key, 3)
    base = dict(q=jax.random.normal(kq, (B, T, H, DK)), k=jax.random.normal(kk, (B, T, H, DK)),
                v=jax.random.normal(kv, (B, T, H, DV)))
    base.update(overrides)
    return base


def _call(**kw):
    return api.validate(kw.pop("q"), kw.pop("k"), kw.pop("v"), kw.pop("erase_key", None), kw.pop("log_decay", None),
                        kw.pop("initial_state", None), kw.pop("segment_ids", None), kw.pop("chunk_size", None),
                        kw.pop("leaf_size", None))


def test_auto_picks_xla_on_cpu_and_logs_each_rejected_kernel_once(caplog):
    api.TABLE._logged.clear()  # other tests in this process may have logged these reasons already
    with caplog.at_level(logging.INFO, logger="mixerlab.pallas_kernels.dispatch"):
        chosen = api.TABLE.choose("auto", _call(**_inputs()))
        again = api.TABLE.choose("auto", _call(**_inputs()))  # e.g. the next layer: no second log line
    assert chosen.name == again.name == "xla"
    skipped = [r.getMessage() for r in caplog.records]
    assert len(skipped) == 2
    assert any("pallas_tpu" in m for m in skipped) and any("pallas_triton" in m for m in skipped)


@pytest.mark.parametrize("name, reason", [("pallas_tpu", ("not implemented yet", "TPU")),
                                          ("pallas_triton", ("not implemented yet", "GPU")),
                                          ("cuda", ("unknown implementation",))])
def test_explicit_unavailable_implementation_raises_one_clear_error(name, reason):
    """On CPU the Pallas kernels cannot serve: either not registered yet, or rejected for the backend."""
    with pytest.raises(ValueError) as err:
        delta_rule(**_inputs(), implementation=name)
    message = str(err.value)
    assert name in message and "cannot serve" in message and any(r in message for r in reason)
    assert "'xla'" in message and "'reference'" in message


def test_registered_kernel_rejection_names_the_reason():
    table = dispatch.OpTable("toy", fallback="xla", planned=())
    table.register(dispatch.Implementation("xla", run=lambda: "xla"))
    table.register(dispatch.Implementation("pallas_tpu", run=lambda: "tpu", fast=True,
                                           supports=lambda call: None if call == "tpu" else "needs the TPU backend"))
    assert table.choose("auto", "tpu").name == "pallas_tpu"
    assert table.choose("auto", "cpu").name == "xla"
    with pytest.raises(ValueError, match="pallas_tpu.*needs the TPU backend"):
        table.choose("pallas_tpu", "cpu")


@pytest.mark.parametrize("overrides, argument", [
    (dict(k=jnp.zeros((B, T, H, DK + 1))), "'k'"),
    (dict(v=jnp.zeros((B + 1, T, H, DV))), "'v'"),
    (dict(q=jnp.zeros((B, T, H))), "'q'"),
    (dict(k=jnp.zeros((B, T, H, DK), jnp.bfloat16)), "'k'"),
    (dict(erase_key=jnp.zeros((B, T, H, DK), jnp.bfloat16)), "'erase_key'"),
    (dict(erase_key=jnp.zeros((B, T, H, DV))), "'erase_key'"),
    (dict(log_decay=jnp.zeros((B, T, H, DK, 1))), "'log_decay'"),
    (dict(log_decay=jnp.zeros((B, T, DK))), "'log_decay'"),
    (dict(initial_state=jnp.zeros((B, H, DV, DK))), "'initial_state'"),
    (dict(segment_ids=jnp.zeros((B, T), jnp.float32)), "'segment_ids'"),
    (dict(segment_ids=jnp.zeros((B, T + 1), jnp.int32)), "'segment_ids'"),
    (dict(q=jnp.zeros((B, T, H, DK), jnp.int32)), "'q'"),
    (dict(chunk_size=0), "chunk_size"),
    (dict(chunk_size=64, leaf_size=3), "leaf_size"),
    (dict(chunk_size=48, leaf_size=16), "leaf_size"),
    (dict(chunk_size=8, leaf_size=16), "leaf_size"),
])
def test_bad_arguments_name_the_argument(overrides, argument):
    with pytest.raises(ValueError, match=argument):
        delta_rule(**_inputs(**overrides))


@pytest.mark.parametrize("chunk, leaf", [(64, 8), (256, 8), (1, 1), (8, 8), (4, 4), (48, 6), (12, 6), (16, 8)])
def test_default_leaf_rule(chunk, leaf):
    assert api.resolve_chunking(chunk, None, "cpu") == (chunk, leaf)


def test_default_chunk_per_backend():
    assert api.resolve_chunking(None, None, "cpu") == (64, 8)
    assert api.resolve_chunking(None, None, "gpu") == (64, 16)  # the leaf the H200 benchmarks measured
    assert api.resolve_chunking(128, None, "gpu") == (128, 16)
    assert api.resolve_chunking(None, None, "tpu") == (256, 8)
    assert api.resolve_chunking(48, 6, "cpu") == (48, 6)  # any leaf with chunk / leaf a power of two
    assert api.resolve_chunking(7, 7, "cpu") == (7, 7)


def test_step_validation():
    q = jnp.zeros((B, H, DK))
    with pytest.raises(ValueError, match="'state'"):
        delta_rule_step(q, q, jnp.zeros((B, H, DV)), state=jnp.zeros((B, H, DK, DK)))
    with pytest.raises(ValueError, match="'log_decay'"):
        delta_rule_step(q, q, jnp.zeros((B, H, DV)), log_decay=jnp.zeros((B, DK)), state=jnp.zeros((B, H, DK, DV)))


def test_normalized_linear_attention_validation():
    inputs = _inputs()
    with pytest.raises(ValueError, match="'k_feat'"):
        normalized_linear_attention(inputs["q"], inputs["k"].astype(jnp.bfloat16), inputs["v"])
