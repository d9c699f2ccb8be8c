"""Token-by-token ``lax.scan`` of the interdomain / S4D recurrences: the ground truth (runs in float64).

Segment resets: before token t, the state is zeroed when ``document[t] != document[t-1]``; the initial
state belongs to the first document of each row.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from mixerlab.pallas_kernels.interdomain import decode


def _reset(x, keep_B):
    return jnp.where(keep_B.reshape((-1,) + (1,) * (x.ndim - 1)), x, jnp.zeros_like(x))


def interdomain_reference(q, k, v, log_modulus, phase, gain, readout, key_state, value_state, document_BT):
    """q, k [B,T,H,R]; v [B,T,H,V]; log_modulus [B,T,H,M]; phase [H,M]; gain [H,2M]; readout [H,2M,2M];
    states [B,H,2M,R], [B,H,2M,V]; document_BT int. Returns (o [B,T,H,V], key_state, value_state)."""
    cos, sin = jnp.cos(phase), jnp.sin(phase)

    def body(carry, xs):
        key, value, prev_doc = carry
        q_t, k_t, v_t, r_t, doc_t = xs
        keep = doc_t == prev_doc
        key, value = _reset(key, keep), _reset(value, keep)
        o, key, value = decode.interdomain_step(q_t, k_t, v_t, r_t, cos, sin, gain, readout, key, value)
        return (key, value, doc_t), o

    xs = tuple(jnp.moveaxis(x, 1, 0) for x in (q, k, v, log_modulus, document_BT))
    (key, value, _), o = jax.lax.scan(body, (key_state, value_state, document_BT[:, 0]), xs)
    return jnp.moveaxis(o, 0, 1), key, value


def s4d_reference(z, log_modulus, phase, gain, readout, state, document_BT):
    """z [B,T,H,C]; log_modulus [B,T,H,M]; readout [H,2M]; state [B,H,2M,C]. Returns (o [B,T,H,C], state)."""
    cos, sin = jnp.cos(phase), jnp.sin(phase)

    def body(carry, xs):
        x, prev_doc = carry
        z_t, r_t, doc_t = xs
        x = _reset(x, doc_t == prev_doc)
        o, x = decode.s4d_step(z_t, r_t, cos, sin, gain, readout, x)
        return (x, doc_t), o

    xs = tuple(jnp.moveaxis(a, 1, 0) for a in (z, log_modulus, document_BT))
    (x, _), o = jax.lax.scan(body, (state, document_BT[:, 0]), xs)
    return jnp.moveaxis(o, 0, 1), x
