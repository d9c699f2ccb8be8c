"""Shared inputs, metrics and x64 switch for the delta-rule tests (imported by the test_delta_rule_* files)."""
from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np

from mixerlab.pallas_kernels import delta_rule

# One jitted entry for every test: each (shapes, dtypes, static tiling) compiles once per process.
jit_delta_rule = jax.jit(delta_rule, static_argnames=("chunk_size", "leaf_size", "implementation"))


@contextlib.contextmanager
def x64():
    """float64 only inside a test: pytest-xdist may run other people's float32 tests in this process."""
    with jax.enable_x64(True):
        yield


def gdn2_inputs(seed, batch, length, heads, key_dim, value_dim, *, dtype=np.float64, decay="channel",
                erase=True, initial_state=True, strong_decay_heads=0):
    """GDN-2-style inputs: q, v ~ N(0,1); k L2-normalised; λ = log σ(N(0,1)); k̂ = b⊙k with b ~ U(0,1).
    ``strong_decay_heads`` first heads get λ ≈ −20 per token and channel (the stress case of
    docs/math/delta_rule.md, 'Boundary pivots')."""
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(batch, length, heads, key_dim)) / np.sqrt(key_dim)
    k = rng.normal(size=(batch, length, heads, key_dim))
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    v = rng.normal(size=(batch, length, heads, value_dim))
    b = rng.uniform(size=(batch, length, heads, key_dim))
    lam = -np.logaddexp(0.0, -rng.normal(size=(batch, length, heads, key_dim)))  # log σ(x)
    lam[:, :, :strong_decay_heads] = -20.0 * rng.uniform(0.5, 1.5, size=(batch, length, strong_decay_heads, key_dim))
    if decay == "head":
        lam = lam[..., 0]
    s0 = rng.normal(size=(batch, heads, key_dim, value_dim))
    cast = lambda x: jnp.asarray(x, dtype)  # noqa: E731
    return dict(
        q=cast(q), k=cast(k), v=cast(v),
        erase_key=cast(b * k) if erase else None,
        log_decay=None if decay is None else jnp.asarray(lam, np.float64 if dtype == np.float64 else np.float32),
        initial_state=jnp.asarray(s0, np.float64 if dtype == np.float64 else np.float32) if initial_state else None,
    )


def as_float64(inputs):
    return {name: None if x is None else x.astype(jnp.float64) for name, x in inputs.items()}


def max_rel_err(x, ref):
    """max |x − ref| / max |ref|."""
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    return float(np.max(np.abs(x - ref)) / np.max(np.abs(ref)))


def rel_rms_err(x, ref):
    """‖x − ref‖₂ / ‖ref‖₂."""
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    return float(np.sqrt(np.sum((x - ref) ** 2) / np.sum(ref ** 2)))


def segment_ids_from_lengths(lengths, batch=1):
    ids = np.concatenate([np.full(n, i, np.int32) for i, n in enumerate(lengths)])
    return jnp.asarray(np.tile(ids, (batch, 1)))


def documents_as_rows(inputs, lengths):
    """Row 0 of ``inputs`` (packed documents of ``lengths``) re-laid as one batch row per document, each
    padded at the end with zero tokens and λ = 0 (identity transitions) to the longest document; the initial
    state goes to the first document only. Returns the batched inputs."""
    width = max(lengths)
    rows, start = {name: [] for name, x in inputs.items() if name != "initial_state" and x is not None}, 0
    for n in lengths:
        for name in rows:
            x = inputs[name][0, start:start + n]
            rows[name].append(jnp.pad(x, [(0, width - n)] + [(0, 0)] * (x.ndim - 1)))
        start += n
    batched = {name: jnp.stack(rows[name]) if name in rows else None for name in inputs}
    first = inputs["initial_state"][:1]
    batched["initial_state"] = jnp.concatenate([first, jnp.zeros((len(lengths) - 1, *first.shape[1:]), first.dtype)])
    return batched


GRAD_NAMES = ("q", "k", "v", "erase_key", "log_decay", "initial_state")


@functools.partial(jax.jit, static_argnames=("implementation", "chunk_size", "leaf_size"))
def outputs_and_grads(inputs, out_weights, state_weights, segment_ids=None, *, implementation,
                      chunk_size=None, leaf_size=None):
    """(o, final_state, {name: d loss / d input}) for loss = Σ o⊙W_o + Σ S_T⊙W_S, in one compiled program
    (module-level and jitted, so equal shapes/dtypes reuse it across tests)."""

    def loss(differentiable):
        out, final = delta_rule(**differentiable, segment_ids=segment_ids, implementation=implementation,
                                chunk_size=chunk_size, leaf_size=leaf_size)
        value = (jnp.sum(out.astype(final.dtype) * out_weights.astype(final.dtype))
                 + jnp.sum(final * state_weights.astype(final.dtype)))
        return value, (out, final)

    differentiable = {name: inputs[name] for name in GRAD_NAMES}
    (_, (out, final)), gradients = jax.value_and_grad(loss, has_aux=True)(differentiable)
    return out, final, gradients
