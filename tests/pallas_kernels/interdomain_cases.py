"""Shared cases of the interdomain kernel tests (Pallas-Triton and Pallas TPU): IA-style op inputs in float64,
the weighted loss whose gradients the tests compare, the float64 token-reference outputs and gradients, error
summaries, and the counters that check a kernel's declared CostEstimate against its traced body."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from mixerlab.pallas_kernels.interdomain import api as ia
from mixerlab.pallas_kernels.interdomain import reference

NAMES = ("q", "k", "v", "log_modulus", "phase", "input_gain", "readout", "key_state", "value_state")


def _inputs(seed, b, t, h, r, dv, m, *, boundaries=(), selective=True, log_modulus=None):
    """Op inputs as float64 numpy arrays (IA-style parameters: S4D-Inv phases, ZOH gain, Hermitian readout)
    and the document index [B, T]. ``log_modulus``: r ~ −U[low, high] per token and mode instead of the S4D one."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((b, t, h, r))
    q /= np.linalg.norm(q, axis=-1, keepdims=True)
    k = rng.standard_normal((b, t, h, r))
    v = rng.standard_normal((b, t, h, dv))
    delta = np.exp(rng.uniform(np.log(1e-2), np.log(0.5), h))
    a_re = -np.exp(rng.uniform(np.log(0.3), np.log(1.0), (h, m)))
    a_im = np.broadcast_to(np.asarray(ia.s4d_inv_imag(m)), (h, m)).astype(np.float64)
    if log_modulus is not None:
        lm = -rng.uniform(*log_modulus, (b, t, h, m) if selective else (h, m))
    elif selective:
        lm = rng.uniform(0.5, 2.0, (b, t, h, 1)) * (delta[:, None] * a_re)
    else:
        lm = delta[:, None] * a_re
    c = rng.standard_normal((2, h, m, m)) / np.sqrt(2 * m)
    gain = np.asarray(ia.zoh_input_gain(jnp.asarray(a_re), jnp.asarray(a_im), jnp.asarray(delta)), np.float64)
    readout = np.asarray(ia.readout_matrix(jnp.asarray(c[0]), jnp.asarray(c[1])), np.float64)
    states = rng.standard_normal((b, h, 2 * m, r)), rng.standard_normal((b, h, 2 * m, dv))
    document = np.tile(np.cumsum(np.isin(np.arange(t), boundaries)), (b, 1)).astype(np.int32)
    return [q, k, v, lm, delta[:, None] * a_im, gain, readout, *states], jnp.asarray(document)


def _weights(seed, b, t, h, r, dv, m):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((b, t, h, dv)), rng.standard_normal((b, h, 2 * m, r)),
            rng.standard_normal((b, h, 2 * m, dv)))


def _loss(fn, weights, shape):
    """Σ o⊙w + Σ key⊙w_k + Σ value⊙w_v of ``fn`` (log_modulus broadcast to [B, T, H, M] as the op does)."""
    def loss(*xs):
        xs = list(xs)
        xs[3] = jnp.broadcast_to(xs[3], shape)
        o, key, value = fn(*xs)
        wide = key.dtype
        total = sum(jnp.sum(x.astype(wide) * w.astype(wide)) for x, w in zip((o, key, value), weights))
        return total, (o, key, value)

    return loss


def _reference(args, document, weights):
    with jax.enable_x64(True):
        wide = [jnp.asarray(a, jnp.float64) for a in args]
        shape = (*args[0].shape[:3], args[4].shape[-1])
        loss = _loss(lambda *x: reference.interdomain_reference(*x, document), [jnp.asarray(w) for w in weights],
                     shape)
        grads, outs = jax.jit(jax.grad(loss, argnums=tuple(range(9)), has_aux=True))(*wide)
        return [np.asarray(x) for x in outs], [np.asarray(g) for g in grads]



def _executed(jaxpr, scale=1):
    """(matmul FLOPs, exp/cos/sin elements) of one program of a kernel jaxpr; scan bodies count ``length``
    times."""
    flops = transcendentals = 0
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name == "dot_general":
            (contract, _), _ = eqn.params["dimension_numbers"]
            lhs = eqn.invars[0].aval.shape
            flops += scale * 2 * math.prod(eqn.outvars[0].aval.shape) * math.prod(lhs[d] for d in contract)
        elif name in ("exp", "cos", "sin"):
            transcendentals += scale * math.prod(eqn.outvars[0].aval.shape)
        assert name not in ("while", "cond"), f"{name}: trip count unknown to this counter"
        inner = scale * (eqn.params["length"] if name == "scan" else 1)
        for value in eqn.params.values():
            sub = getattr(value, "jaxpr", value)
            if hasattr(sub, "eqns"):
                f, t = _executed(sub, inner)
                flops, transcendentals = flops + f, transcendentals + t
    return flops, transcendentals


def _pallas_calls(jaxpr):
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            yield eqn
        for value in eqn.params.values():
            sub = getattr(value, "jaxpr", value)
            if hasattr(sub, "eqns"):
                yield from _pallas_calls(sub)


def op_call(**kw):
    """An ``InterdomainCall`` at the 125M head shape (8 x 4096, H 12, R = Dv = M = 64, bf16, selective decay,
    documents, chunk 64) with ``kw`` replaced: what ``supports`` and the dispatch tests hand the tables."""
    base = dict(op="interdomain", batch=8, length=4096, heads=12, key_dim=64, value_dim=64, modes=64,
                dtype=jnp.dtype(jnp.bfloat16), selective=True, has_initial_state=False, has_segments=True,
                chunk_size=64, sub_chunk_size=8, backend="cpu")
    base.update(kw)
    return ia.InterdomainCall(**base)


def both_ops_loss(q, k, v, lm, phase, gain, readout, seg):
    """A scalar through ``interdomain`` and ``s4d`` with implementation "auto" (outputs and final states), for
    the tests that trace what "auto" picks and compile its gradient."""
    o, state = ia.interdomain(q, k, v, log_modulus=lm, phase=phase, input_gain=gain, readout=readout,
                              segment_ids=seg)
    z, x = ia.s4d(v, log_modulus=lm, phase=phase, input_gain=gain, readout=readout[:, 0], segment_ids=seg)
    return (jnp.sum(o.astype(jnp.float32) ** 2) + jnp.sum(state.key) + jnp.sum(state.value)
            + jnp.sum(z.astype(jnp.float32)) + jnp.sum(x))
