"""The DPLR delta-rule op (docs/math/dplr_delta_rule.md): the chunked pure-JAX form against the float64 token
scan (outputs, final state, gradients of every input), packed documents, the decode step, fla's naive DPLR
recurrence (numpy restatement here; fla itself behind importorskip), argument errors and a TPU compile."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from delta_rule_cases import x64
from mixerlab.pallas_kernels import dplr_delta_rule, dplr_delta_rule_step
from tpu_topologies import TOPOLOGIES, replicated

RWKV7_LOG_DECAY_FLOOR = -np.exp(-0.5)  # fla's rwkv7: λ = −e^{−1/2} σ(·)


def rwkv7_inputs(seed, b, t, h, dk, dv, dtype=np.float64, *, decay_floor=RWKV7_LOG_DECAY_FLOOR):
    """RWKV-7-shaped inputs: α = −κ̂, β = κ̂ ⊙ a with κ̂ unit per head, a ∈ (0, 1), λ ∈ (floor, 0)."""
    rng = np.random.default_rng(seed)
    q, k = rng.standard_normal((2, b, t, h, dk))
    v = rng.standard_normal((b, t, h, dv))
    kappa = rng.standard_normal((b, t, h, dk))
    kappa /= np.linalg.norm(kappa, axis=-1, keepdims=True)
    a = 1 / (1 + np.exp(-rng.standard_normal((b, t, h, dk))))
    lam = decay_floor / (1 + np.exp(-rng.standard_normal((b, t, h, dk))))
    state = rng.standard_normal((b, h, dk, dv))
    cast = lambda x: jnp.asarray(x, dtype)  # noqa: E731
    return dict(q=cast(q), k=cast(k), v=cast(v), alpha=cast(-kappa), beta=cast(kappa * a),
                log_decay=jnp.asarray(lam, jnp.float32 if dtype != np.float64 else np.float64),
                initial_state=jnp.asarray(state, jnp.float32 if dtype != np.float64 else np.float64))


def run(inputs, implementation, **kw):
    x = dict(inputs)
    q, k, v = x.pop("q"), x.pop("k"), x.pop("v")
    return dplr_delta_rule(q, k, v, implementation=implementation, **x, **kw)


def rel_err(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-30))


SEGMENTS = np.repeat([[0, 1, 0, 0], [4, 4, 2, 4]], [9, 5, 20, 3], axis=1)  # row 0 reuses id 0


@pytest.fixture
def float64():
    with x64():
        yield


# ---- chunked form vs the float64 scan ----------------------------------------------------------------------


@pytest.mark.parametrize("t, dk, dv, chunk, leaf, segmented", [
    (37, 8, 6, 16, 4, True), (37, 16, 16, 64, 16, True), (29, 16, 8, 8, 8, False), (5, 8, 8, 64, 16, False),
    (37, 8, 6, 4, 2, True), (37, 8, 6, 2, 2, True)])
def test_xla_matches_reference_float64(float64, t, dk, dv, chunk, leaf, segmented):
    """The last two cases scan over chunk groups (xla.chunked_dplr): 10 chunks as two groups of 5, and 19 as three
    groups of 7 (two identity chunks of padding, documents crossing the groups)."""
    inputs = rwkv7_inputs(0, 2, t, 2, dk, dv)
    seg = jnp.asarray(SEGMENTS[:, :t]) if segmented else None
    o_ref, s_ref = run(inputs, "reference", segment_ids=seg)
    o, s = run(inputs, "xla", segment_ids=seg, chunk_size=chunk, leaf_size=leaf)
    assert rel_err(o, o_ref) < 1e-11 and rel_err(s, s_ref) < 1e-11


def test_general_low_rank_and_per_head_decay(float64):
    """α, β unrelated Gaussian vectors (not RWKV-7's tied pair) and a per-head decay [B, T, H]."""
    inputs = rwkv7_inputs(1, 2, 33, 3, 8, 4)
    rng = np.random.default_rng(9)
    inputs["alpha"], inputs["beta"] = (jnp.asarray(0.3 * rng.standard_normal((2, 33, 3, 8))) for _ in range(2))
    inputs["log_decay"] = -jnp.asarray(rng.uniform(0, 2, (2, 33, 3)))
    o_ref, s_ref = run(inputs, "reference")
    o, s = run(inputs, "xla", chunk_size=16, leaf_size=8)
    assert rel_err(o, o_ref) < 1e-11 and rel_err(s, s_ref) < 1e-11


def test_strong_decay_does_not_overflow(float64):
    """λ = −30 per token: Σλ over a chunk is −1920, so any e^{+Σλ} (a difference of prefix sums) would be inf."""
    inputs = rwkv7_inputs(2, 1, 64, 1, 8, 8, decay_floor=-60.0)
    o_ref, s_ref = run(inputs, "reference")
    o, s = run(inputs, "xla", chunk_size=64, leaf_size=16)
    assert np.all(np.isfinite(o)) and rel_err(o, o_ref) < 1e-11 and rel_err(s, s_ref) < 1e-11


@pytest.mark.parametrize("t, dk, dv, decay_shape, chunk, leaf", [
    (21, 8, 6, "channel", 8, 4), (21, 8, 6, "channel", 2, 2),
    (19, 16, 8, "head", 2, 1)])
def test_gradients_match_reference(float64, t, dk, dv, decay_shape, chunk, leaf):
    """Every input's gradient, initial state included, through the rematerialised scan over chunk groups: the
    second case has 11 chunks (two groups of 6, one identity chunk of padding), the third 10 (two of 5)."""
    inputs = rwkv7_inputs(3, 2, t, 2, dk, dv)
    if decay_shape == "head":
        inputs["log_decay"] = inputs["log_decay"][..., 0]
    seg = jnp.asarray(SEGMENTS[:, :t])
    names = list(inputs)
    probe_o = jnp.asarray(np.random.default_rng(4).standard_normal((2, t, 2, dv)))
    probe_s = jnp.asarray(np.random.default_rng(5).standard_normal((2, 2, dk, dv)))

    def loss(implementation, *arrays):
        o, s = run(dict(zip(names, arrays)), implementation, segment_ids=seg, chunk_size=chunk, leaf_size=leaf)
        return jnp.sum(o * probe_o) + jnp.sum(s * probe_s)

    argnums = tuple(range(1, len(names) + 1))
    grads = jax.jit(jax.grad(loss, argnums), static_argnums=0)  # compiled: the eager scans are slower
    want = grads("reference", *inputs.values())
    got = grads("xla", *inputs.values())
    for name, g, w in zip(names, got, want):
        assert rel_err(g, w) < 1e-10, name



def test_backward_keeps_the_inputs_and_one_state_per_chunk_group():
    """What autodiff saves for the backward pass: the (bfloat16) operands and the state entering each chunk group
    — not the chunk pieces (Q_eff, O_intra, F, G: float32, one K×K and one K×V matrix per chunk) nor per-chunk
    states, which made the op 18× its inputs in TPU memory at the RWKV-7 166M shape."""
    b, t, h, dk, dv, chunk = 2, 1024, 2, 16, 16, 16  # 64 chunks: 8 groups of 8
    inputs = rwkv7_inputs(6, b, t, h, dk, dv, np.float32)
    inputs.update({n: inputs[n].astype(jnp.bfloat16) for n in ("q", "k", "v", "alpha", "beta")})
    names = list(inputs)

    def loss(*arrays):
        o, s = run(dict(zip(names, arrays)), "xla", chunk_size=chunk, leaf_size=4)
        return jnp.sum(o.astype(jnp.float32)) + jnp.sum(s)

    _, backward = jax.vjp(jax.jit(loss), *inputs.values())  # a Partial: its leaves are the saved residuals
    saved = jax.tree.leaves(backward)
    saved_bytes = sum(x.size * x.dtype.itemsize for x in saved)
    input_bytes = sum(x.size * x.dtype.itemsize for x in inputs.values())
    group_states = 8 * b * h * dk * dv * 4
    shapes = [(x.shape, x.dtype) for x in saved]
    assert saved_bytes <= 2 * input_bytes + 2 * group_states, (saved_bytes, input_bytes, shapes)


@pytest.mark.parametrize("dtype, tol", [(jnp.float32, 2e-5), (jnp.bfloat16, 1e-2)])
def test_low_precision_against_float64(dtype, tol):
    """f32 and bf16 operands: the chunked form (float32 state) against the float64 scan of the same
    (rounded) inputs. Tolerances relative to max |o|: f32 2e-5 (chunk 64 of float32 matmuls), bf16 1e-2
    (the output rounded to bf16: 2^-8 relative)."""
    inputs = rwkv7_inputs(6, 2, 45, 2, 16, 16, dtype=dtype)
    seg = jnp.asarray(SEGMENTS[:, :45] if SEGMENTS.shape[1] >= 45 else np.pad(SEGMENTS, ((0, 0), (0, 8)), "edge"))
    o, s = jax.jit(lambda x: run(x, "xla", segment_ids=seg))(inputs)
    assert o.dtype == dtype and s.dtype == jnp.float32
    with x64():
        wide = {n: jnp.asarray(np.asarray(x, np.float64)) for n, x in inputs.items()}
        o_ref, s_ref = run(wide, "reference", segment_ids=seg)
    assert rel_err(o, o_ref) < tol and rel_err(s, s_ref) < tol


# ---- packed documents ----------------------------------------------------------------------------------------


def test_each_document_alone(float64):
    """Row 0 packs documents of ids 0, 1, 0, 0 (the second 0-run is a new document): each output equals that
    document run alone (the numpy recurrence below), the initial state reaches the first document only, the final
    state is the last one's."""
    t = 37
    inputs = rwkv7_inputs(7, 2, t, 2, 8, 4)
    seg = SEGMENTS[:, :t]
    o, s = run(inputs, "xla", segment_ids=jnp.asarray(seg), chunk_size=8, leaf_size=4)
    for row in range(2):
        starts = [0] + [i for i in range(1, t) if seg[row, i] != seg[row, i - 1]] + [t]
        for n, (a, b) in enumerate(zip(starts[:-1], starts[1:])):
            piece = [inputs[name][row:row + 1, a:b] for name in ("q", "k", "v", "alpha", "beta", "log_decay")]
            start = inputs["initial_state"][row:row + 1] if n == 0 else np.zeros((1, 2, 8, 4))
            o_doc, s_doc = fla_dplr_numpy(*piece, start)
            assert rel_err(o[row:row + 1, a:b], o_doc) < 1e-11
        assert rel_err(s[row:row + 1], s_doc) < 1e-11


# ---- decode step ---------------------------------------------------------------------------------------------


def test_decode_steps_equal_the_scan(float64):
    inputs = rwkv7_inputs(8, 2, 11, 2, 8, 6)
    o_ref, s_ref = run(inputs, "reference")
    state = inputs["initial_state"]
    for t in range(11):
        token = {n: x[:, t] for n, x in inputs.items() if n != "initial_state"}
        o, state = dplr_delta_rule_step(token.pop("q"), token.pop("k"), token.pop("v"), state=state, **token)
        assert rel_err(o, o_ref[:, t]) < 1e-12
    assert rel_err(state, s_ref) < 1e-12


# ---- fla's formulation ---------------------------------------------------------------------------------------


def fla_dplr_numpy(q, k, v, alpha, beta, gk, initial_state):
    """numpy float64 restatement of fla's ``dplr_recurrence`` (fla/ops/generalized_delta_rule/dplr/naive.py),
    [B, T, H, D] layout, state [K, V] per head, without its d_k^-1/2 query scale:
    S ← S·exp(gk) (rows) + kᵀv + βᵀ(α S_old);  o = q S."""
    q, k, v, alpha, beta, gk = (np.asarray(x, np.float64) for x in (q, k, v, alpha, beta, gk))
    state = np.array(initial_state, np.float64)
    out = np.zeros(v.shape)
    for t in range(q.shape[1]):
        read = np.einsum("bhk,bhkv->bhv", alpha[:, t], state)
        state = (state * np.exp(gk[:, t])[..., None] + k[:, t][..., None] * v[:, t][..., None, :]
                 + beta[:, t][..., None] * read[..., None, :])
        out[:, t] = np.einsum("bhk,bhkv->bhv", q[:, t], state)
    return out, state


def test_matches_fla_formulation_numpy(float64):
    inputs = rwkv7_inputs(10, 2, 23, 2, 8, 6)
    want_o, want_s = fla_dplr_numpy(*(inputs[n] for n in ("q", "k", "v", "alpha", "beta", "log_decay",
                                                           "initial_state")))
    o, s = run(inputs, "xla", chunk_size=8, leaf_size=4)
    assert rel_err(o, want_o) < 1e-11 and rel_err(s, want_s) < 1e-11


def test_matches_fla_naive_dplr_recurrence():
    torch = pytest.importorskip("torch")
    pytest.importorskip("fla")
    naive = pytest.importorskip("fla.ops.generalized_delta_rule.dplr.naive")
    with x64():
        inputs = rwkv7_inputs(11, 2, 23, 2, 8, 6)
    dk = 8
    # fla's naive casts to float32 inside (alpha too, or it fails on mixed dtypes): float32 tensors, tolerance
    # 1e-5 relative to max |o|. It scales q by d_k^-1/2 inside; pass q·sqrt(d_k) so both compute q S.
    to_torch = lambda x: torch.tensor(np.asarray(x, np.float32)).transpose(1, 2).contiguous()  # noqa: E731
    o_fla, s_fla = naive.dplr_recurrence(
        to_torch(inputs["q"] * dk ** 0.5), to_torch(inputs["k"]), to_torch(inputs["v"]), to_torch(inputs["alpha"]),
        to_torch(inputs["beta"]), to_torch(inputs["log_decay"]),
        initial_state=torch.tensor(np.asarray(inputs["initial_state"], np.float32)))
    with x64():
        o, s = run(inputs, "xla", chunk_size=8, leaf_size=4)
    assert rel_err(o_fla.transpose(1, 2).numpy(), o) < 1e-5 and rel_err(s_fla.numpy(), s) < 1e-5


# ---- argument errors -----------------------------------------------------------------------------------------


def test_errors_name_the_argument():
    x = rwkv7_inputs(12, 1, 8, 2, 4, 4, dtype=np.float32)
    bad = dict(x, alpha=x["alpha"][..., :3])
    with pytest.raises(ValueError, match=r"dplr_delta_rule: argument 'alpha' has shape \(1, 8, 2, 3\)"):
        run(bad, "xla")
    with pytest.raises(ValueError, match=r"argument 'log_decay'.*per head"):
        run(dict(x, log_decay=x["log_decay"][:, :, :1]), "xla")
    with pytest.raises(ValueError, match="leaf_size=5 does not divide chunk_size=16"):
        run(x, "xla", chunk_size=16, leaf_size=5)
    with pytest.raises(ValueError, match=r"argument 'log_decay' is outside its domain"):
        run(dict(x, log_decay=-x["log_decay"]), "xla")
    with pytest.raises(ValueError, match="implementation='pallas_tpu'"):
        run(x, "pallas_tpu")
    with pytest.raises(ValueError, match=r"dplr_delta_rule_step: argument 'beta'"):
        dplr_delta_rule_step(x["q"][:, 0], x["k"][:, 0], x["v"][:, 0], alpha=x["alpha"][:, 0],
                             beta=x["beta"][:, 0, :1], state=x["initial_state"])


# ---- TPU compile of the xla path (libtpu, no TPU needed) ---------------------------------------------------


@pytest.mark.tpu_compile
# make test compiles for v5p (the cheapest: 11 s against 23-29 s), as test_rwkv7_layer the layer around this op;
# v5e and v6e are extended
@pytest.mark.parametrize("gen", [g if g == "v5p" else pytest.param(g, marks=pytest.mark.extended) for g in TOPOLOGIES])
def test_compiles_forward_backward_for_tpu(gen):
    """The xla path (what "auto" runs on TPU: no Pallas kernel here), forward + backward, bf16 operands, with
    segments. 12–27 s each on the loaded 2-core machine."""
    rep = replicated(gen)
    b, t, h, dk, dv = 1, 256, 2, 64, 64
    sd = lambda s, d=jnp.bfloat16: jax.ShapeDtypeStruct(s, d, sharding=rep)  # noqa: E731
    specs = [sd((b, t, h, dk)), sd((b, t, h, dk)), sd((b, t, h, dv)), sd((b, t, h, dk)), sd((b, t, h, dk)),
             sd((b, t, h, dk), jnp.float32), sd((b, h, dk, dv), jnp.float32), sd((b, t), jnp.int32)]

    def loss(q, k, v, alpha, beta, lam, s0, seg):
        o, s = dplr_delta_rule(q, k, v, alpha=alpha, beta=beta, log_decay=lam, initial_state=s0, segment_ids=seg)
        return jnp.sum(o.astype(jnp.float32) ** 2) + jnp.sum(s ** 2)

    compiled = jax.jit(jax.value_and_grad(loss, argnums=tuple(range(7)))).lower(*specs).compile()
    assert compiled.cost_analysis() is not None
