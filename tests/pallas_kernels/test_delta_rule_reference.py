"""The reference against independent naive recurrences written here in FLA's formulation
(docs/math/delta_rule.md, 'Mechanisms as substitutions'),
the decode step (item 2) and state continuation (item 3). Every mechanism runs through both "reference" and
"xla"."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from delta_rule_cases import gdn2_inputs, jit_delta_rule, max_rel_err, x64
from mixerlab.pallas_kernels import delta_rule_step, normalized_linear_attention

TOL = 1e-12
B, T, H, DK, DV = 2, 45, 2, 8, 6
TILING = dict(chunk_size=16, leaf_size=4)


@pytest.fixture(autouse=True)
def _float64():
    with x64():
        yield


# ---- naive recurrences in FLA's per-mechanism form (numpy, float64, state [K, V] per head) -------------


def naive_gdn2(q, k, v, b, w, g, scale):
    """S ← S·exp(g) (rows); S ← S + kᵀ (w⊙v − (b⊙k) S); o = scale·q S."""
    q, k, v, b, w, g = (np.asarray(x, np.float64) for x in (q, k, v, b, w, g))
    state = np.zeros((q.shape[0], q.shape[2], q.shape[3], v.shape[3]))
    out = np.zeros(v.shape)
    for t in range(q.shape[1]):
        state = state * np.exp(g[:, t])[..., None]
        read = np.einsum("bhk,bhkv->bhv", b[:, t] * k[:, t], state)
        state = state + k[:, t][..., None] * (w[:, t] * v[:, t] - read)[..., None, :]
        out[:, t] = np.einsum("bhk,bhkv->bhv", scale * q[:, t], state)
    return out


def naive_kda(q, k, v, beta, g, scale):
    """FLA naive KDA: S ← S·exp(g); S ← S + (β k)ᵀ (v − k S); o = scale·q S  (β per head)."""
    q, k, v, beta, g = (np.asarray(x, np.float64) for x in (q, k, v, beta, g))
    state = np.zeros((q.shape[0], q.shape[2], q.shape[3], v.shape[3]))
    out = np.zeros(v.shape)
    for t in range(q.shape[1]):
        state = state * np.exp(g[:, t])[..., None]
        delta = v[:, t] - np.einsum("bhk,bhkv->bhv", k[:, t], state)
        state = state + (beta[:, t, :, None] * k[:, t])[..., None] * delta[..., None, :]
        out[:, t] = np.einsum("bhk,bhkv->bhv", scale * q[:, t], state)
    return out


def naive_gated_delta(q, k, v, beta, g, scale):
    """FLA naive gated delta rule: scalar decay S ← exp(g) S; u = β(v − k S); S ← S + kᵀ u."""
    q, k, v, beta, g = (np.asarray(x, np.float64) for x in (q, k, v, beta, g))
    state = np.zeros((q.shape[0], q.shape[2], q.shape[3], v.shape[3]))
    out = np.zeros(v.shape)
    for t in range(q.shape[1]):
        state = state * np.exp(g[:, t])[..., None, None]
        u = beta[:, t, :, None] * (v[:, t] - np.einsum("bhk,bhkv->bhv", k[:, t], state))
        state = state + k[:, t][..., None] * u[..., None, :]
        out[:, t] = np.einsum("bhk,bhkv->bhv", scale * q[:, t], state)
    return out


def naive_delta_net(q, k, v, beta, scale):
    return naive_gated_delta(q, k, v, beta, np.zeros(beta.shape), scale)


def naive_linear_attention(q, k, v, scale):
    """o_t = scale·q_t Σ_{s≤t} k_sᵀ v_s."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    kv = np.cumsum(np.einsum("bthk,bthv->bthkv", k, v), axis=1)
    return np.einsum("bthk,bthkv->bthv", scale * q, kv)


def _raw(seed):
    rng = np.random.default_rng(seed)
    q, k = rng.normal(size=(2, B, T, H, DK))
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    v = rng.normal(size=(B, T, H, DV))
    beta = rng.uniform(size=(B, T, H))
    g_channel = -np.logaddexp(0.0, -rng.normal(size=(B, T, H, DK)))
    g_head = g_channel[..., 0]
    b, gamma = rng.uniform(size=(2, B, T, H, DK))
    w = rng.uniform(size=(B, T, H, DV))
    return q, k, v, beta, g_channel, g_head, b, w, gamma


def _core(impl, q_hat, k, v_hat, erase=None, lam=None):
    arr = lambda x: None if x is None else jnp.asarray(x, jnp.float64)  # noqa: E731
    out, _ = jit_delta_rule(arr(q_hat), arr(k), arr(v_hat), erase_key=arr(erase), log_decay=arr(lam),
                            implementation=impl, **(TILING if impl == "xla" else {}))
    return out


IMPLS = ["reference", "xla"]
SCALE = DK ** -0.5


@pytest.mark.parametrize("impl", IMPLS)
def test_gdn2_with_beta_gates_is_kda(impl):
    q, k, v, beta, g, _, _, _, _ = _raw(10)
    beta_k, beta_v = beta[..., None] * np.ones(DK), beta[..., None] * np.ones(DV)
    ours = _core(impl, SCALE * q, k, beta_v * v, erase=beta_k * k, lam=g)  # GDN-2 with b = w = β·1
    assert max_rel_err(ours, naive_kda(q, k, v, beta, g, SCALE)) <= TOL
    assert max_rel_err(ours, naive_gdn2(q, k, v, beta_k, beta_v, g, SCALE)) <= TOL


@pytest.mark.parametrize("impl", IMPLS)
def test_kda_with_scalar_decay_is_gdn(impl):
    q, k, v, beta, _, g, _, _, _ = _raw(11)
    expected = naive_gated_delta(q, k, v, beta, g, SCALE)
    channel = _core(impl, SCALE * q, k, beta[..., None] * v, erase=beta[..., None] * k,
                    lam=np.broadcast_to(g[..., None], g.shape + (DK,)))
    per_head = _core(impl, SCALE * q, k, beta[..., None] * v, erase=beta[..., None] * k, lam=g)
    assert max_rel_err(channel, expected) <= TOL
    assert max_rel_err(per_head, expected) <= TOL


@pytest.mark.parametrize("impl", IMPLS)
def test_gdn_without_decay_is_delta_net(impl):
    q, k, v, beta, _, _, _, _, _ = _raw(12)
    ours = _core(impl, SCALE * q, k, beta[..., None] * v, erase=beta[..., None] * k, lam=np.zeros((B, T, H)))
    assert max_rel_err(ours, naive_delta_net(q, k, v, beta, SCALE)) <= TOL


@pytest.mark.parametrize("impl", IMPLS)
def test_gdn2_without_erase_or_decay_is_linear_attention(impl):
    q, k, v, _, _, _, _, _, _ = _raw(13)
    ours = _core(impl, SCALE * q, k, v, erase=0.0 * k, lam=np.zeros((B, T, H, DK)))
    no_args = _core(impl, SCALE * q, k, v)
    expected = naive_linear_attention(q, k, v, SCALE)
    assert max_rel_err(ours, expected) <= TOL
    assert max_rel_err(no_args, expected) <= TOL


@pytest.mark.parametrize("impl", IMPLS)
def test_muir_with_unit_gain_is_gdn2(impl):
    q, k, v, _, g, _, b, w, gamma = _raw(14)
    expected = naive_gdn2(q, k, v, b, w, g, SCALE)
    unit = _core(impl, SCALE * np.ones_like(gamma) * q, k, w * v, erase=b * k, lam=g)
    assert max_rel_err(unit, expected) <= TOL
    # a readout gain only rescales q̂ channels: Muir(γ) == GDN-2 on q ⊙ γ
    gained = _core(impl, SCALE * gamma * q, k, w * v, erase=b * k, lam=g)
    assert max_rel_err(gained, naive_gdn2(gamma * q, k, v, b, w, g, SCALE)) <= TOL


@pytest.mark.parametrize("impl", IMPLS)
def test_normalized_linear_attention_is_elu_plus_one_formula(impl):
    q, k, v, _, _, _, _, _, _ = _raw(15)
    phi = lambda x: np.where(x > 0, x + 1.0, np.exp(x))  # noqa: E731  ELU + 1
    eps = 1e-6
    kv = np.cumsum(np.einsum("bthk,bthv->bthkv", phi(k), v), axis=1)
    z = np.cumsum(phi(k), axis=1)
    expected = (np.einsum("bthk,bthkv->bthv", phi(q), kv)
                / (np.einsum("bthk,bthk->bth", phi(q), z)[..., None] + eps))
    fn = jax.jit(normalized_linear_attention, static_argnames=("chunk_size", "leaf_size", "implementation"))
    out, state = fn(jnp.asarray(phi(q)), jnp.asarray(phi(k)), jnp.asarray(v), eps=eps, implementation=impl,
                    **(TILING if impl == "xla" else {}))
    assert state.shape == (B, H, DK, DV + 1)
    assert max_rel_err(out, expected) <= TOL
    assert max_rel_err(state[..., DV], z[:, -1]) <= TOL  # last column of the state is z


# ---- decode and continuation ---------------------------------------------------------------------------


@pytest.mark.parametrize("decay", ["channel", "head"])
def test_decode_loop_equals_reference(decay):
    inputs = gdn2_inputs(16, B, 40, H, DK, DV, decay=decay)
    ref_out, ref_state = jit_delta_rule(**inputs, implementation="reference")
    step = jax.jit(delta_rule_step)
    state, outs = inputs["initial_state"], []
    for t in range(40):
        out, state = step(inputs["q"][:, t], inputs["k"][:, t], inputs["v"][:, t],
                          erase_key=inputs["erase_key"][:, t], log_decay=inputs["log_decay"][:, t], state=state)
        outs.append(out)
    assert max_rel_err(jnp.stack(outs, axis=1), ref_out) <= 1e-13
    assert max_rel_err(state, ref_state) <= 1e-13


@pytest.mark.parametrize("impl, split", [("reference", 17), ("xla", 40)])
def test_split_and_continue_equals_one_pass(impl, split):
    inputs = gdn2_inputs(17, B, 100, H, DK, DV)
    tiling = dict(chunk_size=32, leaf_size=8) if impl == "xla" else {}
    full_out, full_state = jit_delta_rule(**inputs, implementation=impl, **tiling)
    prefix = {n: x if n == "initial_state" else x[:, :split] for n, x in inputs.items()}
    suffix = {n: x if n == "initial_state" else x[:, split:] for n, x in inputs.items()}
    out_a, state_a = jit_delta_rule(**prefix, implementation=impl, **tiling)
    suffix["initial_state"] = state_a
    out_b, state_b = jit_delta_rule(**suffix, implementation=impl, **tiling)
    assert max_rel_err(jnp.concatenate([out_a, out_b], axis=1), full_out) <= TOL
    assert max_rel_err(state_b, full_state) <= TOL


def test_decode_keeps_float32_state_for_bfloat16_inputs():
    with jax.enable_x64(False):
        rng = np.random.default_rng(18)
        q, k = (jnp.asarray(rng.normal(size=(1, 2, 4)), jnp.bfloat16) for _ in range(2))
        v = jnp.asarray(rng.normal(size=(1, 2, 3)), jnp.bfloat16)
        out, state = delta_rule_step(q, k, v, state=jnp.zeros((1, 2, 4, 3), jnp.float32))
        assert out.dtype == jnp.bfloat16 and state.dtype == jnp.float32
