"""Document boundaries exactly on chunk boundaries, and decay from ~0 to strong, for every chunked
implementation of every op against its token-by-token reference:

* delta_rule "xla" (forward and custom VJP, float64) and the Pallas TPU kernel in interpret mode (forward and
  backward kernels, float32) — a document starting at a chunk's first token must reset the carried state, and
  with weak decay (λ ≈ −0.01, chunk-end decay ≈ e^−0.6) the carried state's chunk-end factor is visible, where
  the default λ = log σ(N(0,1)) makes it ≈ e^−45 and hides an error in it;
* vla "xla" (the A-pass restarts at I/λ₀ when a document starts at a chunk's first token);
* interdomain and s4d "xla" (selective decay from ~0 to strong).

Property-style cases: document cuts drawn from the chunk multiples plus a few random positions, and a decay
scale per head drawn log-uniformly, weak (1e-4 … 0.1 per token) on one head and strong (0.1 … 20) on the other.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from delta_rule_cases import gdn2_inputs, max_rel_err, outputs_and_grads, rel_rms_err, x64
from mixerlab.pallas_kernels.delta_rule import pallas_tpu
from mixerlab.pallas_kernels.interdomain import api as ia
from mixerlab.pallas_kernels.vla import api as vla_api

# One jitted entry per op (eager dispatch compiles every primitive separately: slow on CPU).
_vla = jax.jit(vla_api.vla, static_argnames=("chunk_size", "implementation"))
_interdomain = jax.jit(ia.interdomain, static_argnames=("chunk_size", "sub_chunk_size", "implementation"))
_s4d = jax.jit(ia.s4d, static_argnames=("chunk_size", "sub_chunk_size", "implementation"))

F64_TOL = 1e-10  # float64 chunked forms vs the float64 references: observed ≤ 2e-15 (all cases)
F32_TOL = 1e-4  # float32 Pallas interpret vs float64 (relative RMS), as test_delta_rule_pallas_tpu.py;
# observed ≤ 4e-7 here


def _ids(cuts, length, batch=1):
    """Segment ids [batch, length] with a new document at every position in ``cuts``."""
    ids = np.searchsorted(np.sort(np.asarray(cuts)), np.arange(length), side="right")
    return jnp.asarray(np.tile(ids.astype(np.int32), (batch, 1)))


def _random_cuts(rng, length, chunk):
    """At least two document starts exactly at chunk starts, plus two anywhere (maybe also on one)."""
    on_chunk = rng.choice(np.arange(chunk, length, chunk), size=2, replace=False)
    anywhere = rng.choice(np.arange(1, length), size=2, replace=False)
    return np.unique(np.concatenate([on_chunk, anywhere]))


def _decay_scales(rng):
    """Per-token decay magnitudes: head 0 weak (1e-4 … 0.1), head 1 strong (0.1 … 20)."""
    return np.array([10.0 ** rng.uniform(-4, -1), 10.0 ** rng.uniform(-1, np.log10(20.0))])


def _log_decay(rng, shape, scales):
    """λ = −scale_h · U(0.5, 1.5), [B, T, H, K]."""
    return -scales[None, None, :, None] * rng.uniform(0.5, 1.5, size=shape)


# ---------------------------------------------------------------------------------------------------------
# delta rule: xla forward + custom VJP (float64)

DELTA_CASES = [  # (name, T, chunk, leaf, cuts or None for random, seed)
    # document 1 starts exactly at chunk 1 and fills chunks 1-2: a reset on a chunk boundary, then a carried
    # state that leaves chunk 2 through its chunk-end decay π_C ≈ e^−0.64 into the final state
    ("docs_64_128_chunk64_weak", 192, 64, 8, (64,), 0),
    ("random_0", 96, 16, 4, None, 1),
    ("random_1", 96, 16, 4, None, 2),
    ("random_2", 96, 16, 4, None, 3),
]


@pytest.mark.parametrize("name, length, chunk, leaf, cuts, seed", DELTA_CASES, ids=[c[0] for c in DELTA_CASES])
def test_delta_rule_xla_documents_on_chunk_boundaries(name, length, chunk, leaf, cuts, seed):
    """Outputs, final state and all six gradients of "xla" == "reference" (float64, ≤ 1e-10 of max |ref|)."""
    rng = np.random.default_rng(seed)
    with x64():
        inputs = gdn2_inputs(seed, 1, length, 2, 8, 8)
        scales = np.array([0.01, 0.01]) if cuts is not None else _decay_scales(rng)
        inputs["log_decay"] = jnp.asarray(_log_decay(rng, inputs["q"].shape, scales))
        ids = _ids(cuts if cuts is not None else _random_cuts(rng, length, chunk), length)
        w_out = jnp.asarray(rng.normal(size=inputs["v"].shape))
        w_state = jnp.asarray(rng.normal(size=inputs["initial_state"].shape))
        ref = outputs_and_grads(inputs, w_out, w_state, ids, implementation="reference")
        got = outputs_and_grads(inputs, w_out, w_state, ids, implementation="xla", chunk_size=chunk, leaf_size=leaf)
        assert max_rel_err(got[0], ref[0]) <= F64_TOL, ("o", max_rel_err(got[0], ref[0]))
        assert max_rel_err(got[1], ref[1]) <= F64_TOL, ("state", max_rel_err(got[1], ref[1]))
        for n in ref[2]:
            assert max_rel_err(got[2][n], ref[2][n]) <= F64_TOL, ("d_" + n, max_rel_err(got[2][n], ref[2][n]))


# ---------------------------------------------------------------------------------------------------------
# delta rule: Pallas TPU kernel in interpret mode (forward and backward kernels)


def test_delta_rule_pallas_tpu_interpret_weak_decay_documents_on_chunk_boundary():
    """C = 64, three chunks, documents (64, 128): document 1 starts exactly at chunk 1's first token (a reset on
    a chunk boundary) and fills chunks 1 and 2, so chunk 2's carried state leaves through its chunk-end decay
    π_C ≈ e^−0.64 into the final state (forward) and d(final state) flows back through it (backward).
    λ ≈ −0.01 per token and channel; d = 64 (the kernel's smallest)."""
    length, chunk, leaf = 192, 64, 8
    rng = np.random.default_rng(7)
    inputs = gdn2_inputs(7, 1, length, 1, 64, 64, dtype=np.float32)
    inputs["log_decay"] = jnp.asarray(_log_decay(rng, inputs["q"].shape, np.array([0.01])), jnp.float32)
    ids = _ids((64,), length)
    w_out = rng.normal(size=inputs["v"].shape)
    w_state = rng.normal(size=inputs["initial_state"].shape)

    def loss(x):
        out, state = pallas_tpu.delta_rule_interpret(**x, segment_ids=ids, chunk_size=chunk, leaf_size=leaf)
        return jnp.sum(out * w_out.astype(np.float32)) + jnp.sum(state * w_state.astype(np.float32)), (out, state)

    (_, (out, state)), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(inputs)
    with x64():
        ref_out, ref_state, ref_grads = outputs_and_grads(
            {n: jnp.asarray(np.asarray(x), jnp.float64) for n, x in inputs.items()}, jnp.asarray(w_out),
            jnp.asarray(w_state), ids, implementation="reference")
    errors = {"o": rel_rms_err(out, ref_out), "state": rel_rms_err(state, ref_state)}
    errors.update({"d_" + n: rel_rms_err(grads[n], ref_grads[n]) for n in ref_grads})
    assert all(e <= F32_TOL for e in errors.values()), errors


# ---------------------------------------------------------------------------------------------------------
# vla: xla (A-pass chunks + delta-rule S-pass) vs the reference scan (float64)

VLA_CASES = [("docs_8_12_4_8_chunk4", (8, 20, 24), 4, 0), ("random_0", None, 4, 1), ("random_1", None, 4, 2)]


@pytest.mark.parametrize("name, cuts, chunk, seed", VLA_CASES, ids=[c[0] for c in VLA_CASES])
def test_vla_xla_documents_on_chunk_boundaries(name, cuts, chunk, seed):
    length = 32
    rng = np.random.default_rng(seed)
    with x64():
        q = jax.nn.elu(jnp.asarray(rng.normal(size=(1, length, 2, 8)))) + 1.0
        k = jax.nn.elu(jnp.asarray(rng.normal(size=(1, length, 2, 8)))) + 1.0
        v = jnp.asarray(rng.normal(size=(1, length, 2, 6)))
        p = jnp.asarray(rng.normal(size=(1, length, 2, 8)) + 0.5)
        m = rng.normal(size=(1, 2, 8, 8)) / np.sqrt(8)
        state = (jnp.asarray(rng.normal(size=(1, 2, 8, 6))), jnp.asarray(5.0 * np.eye(8) + m @ np.swapaxes(m, -1, -2)))
        ids = _ids(cuts if cuts is not None else _random_cuts(rng, length, chunk), length)
        kw = dict(penalty_key=p, initial_state=state, segment_ids=ids)
        o_r, (s_r, a_r) = _vla(q, k, v, **kw, implementation="reference")
        o, (s, a) = _vla(q, k, v, **kw, chunk_size=chunk, implementation="xla")
        errors = (max_rel_err(o, o_r), max_rel_err(s, s_r), max_rel_err(a, a_r))
        assert max(errors) <= F64_TOL, errors


# ---------------------------------------------------------------------------------------------------------
# interdomain and s4d: xla vs the token reference (float64), selective decay from ~0 to strong

IA_CASES = [("docs_16_8_chunk8_weak", (16, 24), 8, 0), ("random_0", None, 8, 1), ("random_1", None, 8, 2)]


@pytest.mark.parametrize("name, cuts, chunk, seed", IA_CASES, ids=[c[0] for c in IA_CASES])
def test_interdomain_and_s4d_xla_documents_on_chunk_boundaries(name, cuts, chunk, seed):
    length, heads, r_dim, v_dim, modes = 32, 2, 4, 3, 4
    rng = np.random.default_rng(seed)
    with x64():
        cast = jnp.asarray
        q = rng.normal(size=(1, length, heads, r_dim))
        q = cast(q / np.linalg.norm(q, axis=-1, keepdims=True))
        k, v = cast(rng.normal(size=(1, length, heads, r_dim))), cast(rng.normal(size=(1, length, heads, v_dim)))
        scales = np.array([0.01, 0.01]) if cuts is not None else _decay_scales(rng)
        log_mod = cast(_log_decay(rng, (1, length, heads, modes), scales))
        phase = cast(rng.uniform(0.0, np.pi, size=(heads, modes)))
        gain = cast(rng.normal(size=(heads, 2 * modes)))
        c_re, c_im = (cast(rng.normal(size=(heads, modes, modes)) / modes) for _ in range(2))
        dyn = dict(log_modulus=log_mod, phase=phase, input_gain=gain)
        ids = _ids(cuts if cuts is not None else _random_cuts(rng, length, chunk), length)
        state = ia.InterdomainState(cast(rng.normal(size=(1, heads, 2 * modes, r_dim))),
                                    cast(rng.normal(size=(1, heads, 2 * modes, v_dim))))
        kw = dict(**dyn, readout=ia.readout_matrix(c_re, c_im), initial_state=state, segment_ids=ids)
        o_r, s_r = _interdomain(q, k, v, **kw, implementation="reference")
        o, s = _interdomain(q, k, v, **kw, implementation="xla", chunk_size=chunk, sub_chunk_size=4)
        errors = (max_rel_err(o, o_r), max_rel_err(s.key, s_r.key), max_rel_err(s.value, s_r.value))
        assert max(errors) <= F64_TOL, ("interdomain", errors)

        readout = ia.readout_vector(c_re, c_im, cast(rng.normal(size=(heads, modes))))
        kw = dict(**dyn, readout=readout, initial_state=state.value, segment_ids=ids)
        o_r, s_r = _s4d(v, **kw, implementation="reference")
        o, s = _s4d(v, **kw, implementation="xla", chunk_size=chunk, sub_chunk_size=4)
        errors = (max_rel_err(o, o_r), max_rel_err(s, s_r))
        assert max(errors) <= F64_TOL, ("s4d", errors)
