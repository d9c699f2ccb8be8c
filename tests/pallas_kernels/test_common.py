"""The shared op helpers: document index, chunk layout, and the value-domain checks every op makes."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mixerlab.pallas_kernels import common, delta_rule, interdomain, vla


def test_document_index_counts_boundaries_and_reused_ids():
    seg = jnp.asarray([[1, 1, 2, 2, 1, 1, 0]])  # id 1 reused after 2: a new document; padding 0 is one more
    assert np.asarray(common.document_index(seg, 1, 7)).tolist() == [[0, 0, 1, 1, 2, 2, 3]]
    assert np.asarray(common.document_index(None, 2, 3)).tolist() == [[0, 0, 0], [0, 0, 0]]


def test_chunk_documents_carries_the_document_of_the_token_before_the_chunk():
    # boundaries inside chunk 0, exactly at the start of chunk 2, and none in chunk 1
    document = jnp.asarray([[0, 0, 1, 1, 1, 1, 2, 2]])
    chunks, carried = common.chunk_documents(document, 2)
    assert np.asarray(chunks).tolist() == [[[0, 0], [1, 1], [1, 1], [2, 2]]]
    assert np.asarray(carried).tolist() == [[0, 0, 1, 1]]  # chunk 3 starts a document: carried 1, own 2


def test_pad_time_edge_keeps_padding_in_the_last_document():
    x = jnp.asarray([[0, 1, 1]])
    assert np.asarray(common.pad_time(x, 4, mode="edge")).tolist() == [[0, 1, 1, 1]]
    assert common.pad_time(x, 3) is x


def _qkv(b=1, t=8, h=1, d=4):
    keys = jax.random.split(jax.random.key(0), 3)
    return [jax.random.normal(kk, (b, t, h, d)) for kk in keys]


def test_delta_rule_rejects_a_positive_log_decay_eagerly_and_under_jit(monkeypatch):
    q, k, v = _qkv()
    bad = jnp.full(q.shape, -0.1).at[0, 3, 0, 1].set(0.5)
    with pytest.raises(ValueError, match=r"delta_rule: argument 'log_decay' is outside its domain.*<= 0.*0\.5"):
        delta_rule(q, k, v, log_decay=bad)
    f = jax.jit(lambda lam: delta_rule(q, k, v, log_decay=lam, implementation="xla"))
    assert np.isfinite(np.asarray(f(jnp.full(q.shape, -0.1))[0])).all()  # valid values pass through jit
    out, state = f(bad)  # under jit: no host sync by default; the outputs say it (all NaN), never a wrong number
    assert np.isnan(np.asarray(out)).all() and np.isnan(np.asarray(state)).all()
    monkeypatch.setattr(common, "CHECK_DOMAINS_UNDER_JIT", True)  # MIXERLAB_CHECK_DOMAINS=1: the error itself
    g = jax.jit(lambda lam: delta_rule(q, k, v, log_decay=lam, implementation="xla")[0])
    with pytest.raises(Exception, match=r"log_decay' is outside its domain"):
        np.asarray(g(bad))
    with pytest.raises(ValueError, match="outside its domain"):  # NaN is not <= 0 either
        delta_rule(q, k, v, log_decay=jnp.full(q.shape[:3], jnp.nan))


def test_vla_rejects_an_initial_penalty_that_is_not_positive_definite():
    q, k, v = _qkv()
    s0 = jnp.zeros((1, 1, 4, 4))
    eye = jnp.eye(4)[None, None]
    # Closed-over arrays stay concrete under jit, so the check runs at trace time and the op compiles once
    # instead of running eagerly op by op.
    run = lambda a0: jax.jit(lambda: vla(q, k, v, initial_state=(s0, a0))[0])()  # noqa: E731
    assert np.isfinite(np.asarray(run(2.0 * eye))).all()  # positive definite: accepted
    with pytest.raises(ValueError, match=r"vla: argument 'initial_state\[1\] \(A\)' is outside its domain"):
        run(eye.at[..., 2, 2].set(-1.0))
    with pytest.raises(ValueError, match="symmetric positive-definite"):
        run(eye.at[..., 0, 1].set(0.5))  # not symmetric


def test_interdomain_rejects_a_positive_log_modulus():
    b, t, h, r, m, dv = 1, 6, 1, 4, 3, 4
    keys = jax.random.split(jax.random.key(1), 3)
    q, k = (jax.random.normal(kk, (b, t, h, r)) for kk in keys[:2])
    v = jax.random.normal(keys[2], (b, t, h, dv))
    args = dict(phase=jnp.ones((h, m)), input_gain=jnp.ones((h, 2 * m)), readout=jnp.eye(2 * m)[None])
    interdomain(q, k, v, log_modulus=-jnp.ones((h, m)), **args)
    bad = jnp.ones((h, m)).at[0, 1].set(0.25) - 0.5
    with pytest.raises(ValueError, match=r"interdomain: argument 'log_modulus' is outside its domain"):
        interdomain(q, k, v, log_modulus=bad, **args)
    out, _ = jax.jit(lambda r: interdomain(q, k, v, log_modulus=r, **args))(bad)
    assert np.isnan(np.asarray(out)).all()
