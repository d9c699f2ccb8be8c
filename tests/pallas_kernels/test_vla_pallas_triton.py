"""Pallas-Triton VLA A-pass (pallas_kernels/vla/pallas_triton.py) and the op's "pallas_triton" implementation.

CPU: the kernels in interpret mode against the float64 reference scan (pallas_kernels/vla/reference.py):
α̂, the final A and the custom-VJP gradients w.r.t. k̂, u and A₀ (one compiled function shared by every case:
the cases differ only in data — documents, refreshes, keys); the whole op (A-pass kernel + delta-rule S-pass)
with all its gradients in float32 and bfloat16; lowering for CUDA without a GPU.
GPU (``-m gpu``, skipped elsewhere): the compiled op against the reference.
"""
from __future__ import annotations

import functools
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mixerlab.pallas_kernels.vla import api, pallas_triton, reference

LAMBDA0, RHO, EPS = 0.1, 0.05, 1e-4  # ρ larger than the default so that the refreshes show in every number
ANCHOR_EVERY = 8  # several anchor chunks at T = 45 (padded to 48)


def _rel_rms(x, ref):
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(x - ref) / np.linalg.norm(ref))


def _sym(x):
    x = np.asarray(x, np.float64)
    return 0.5 * (x + np.swapaxes(x, -1, -2))


def _documents(batch, length, boundaries):
    starts = np.isin(np.arange(length), boundaries).astype(np.int32)
    return jnp.asarray(np.tile(np.cumsum(starts), (batch, 1)).astype(np.int32))


def _spd(rng, batch, heads, dim):
    m = rng.normal(size=(batch, heads, dim, dim)) / np.sqrt(dim)
    return np.eye(dim) * 5.0 + m @ np.swapaxes(m, -1, -2)


def _a_pass_inputs(seed, boundaries, period, offset, initial_position, zero_rows=()):
    """Unit k̂ and u (float32), SPD A₀, document index and refresh mask; ``zero_rows``: tokens whose k̂ and u
    are zero (the ε floors)."""
    b, t, h, d = 2, 45, 2, 16
    rng = np.random.default_rng(seed)
    k = np.asarray(jax.nn.elu(rng.normal(size=(b, t, h, d)))) + 1.0
    p = rng.normal(size=(b, t, h, d)) + 0.5
    k[:, list(zero_rows)] = 0.0
    p[:, list(zero_rows)] = 0.0
    k_hat = api.normalize(jnp.asarray(k, jnp.float32), EPS)
    u = api.normalize(jnp.asarray(p, jnp.float32), EPS)
    document = _documents(b, t, boundaries)
    positions = api.document_positions(document, jnp.asarray(initial_position, jnp.int32))
    refresh = api.refresh_mask(positions, period, offset)
    weights = rng.normal(size=(b, t, h, d)), rng.normal(size=(b, h, d, d))
    return (k_hat, u, jnp.asarray(_spd(rng, b, h, d), jnp.float32), document, refresh), weights


# the forward kernels: token by token (anchors every 8 tokens), and by chunks — tiles of 16 rows inside anchor
# blocks of 8 (every chunk shorter than its tile) and of 32 (several chunks per block, some 16 rows long)
FORWARDS = {"token": dict(forward="token", anchor_every=ANCHOR_EVERY),
            "chunked_8": dict(forward="chunked", anchor_every=ANCHOR_EVERY, chunk_rows=16),
            "chunked_32": dict(forward="chunked", anchor_every=32, chunk_rows=16)}
# and the split kernels (forward: the token steps, then g read out per anchor block; backward: the Ā scan, then A
# replayed per anchor block), anchor blocks of 8 (documents start inside blocks and on their edges) and of 32
# (the last block partial), and the split backward behind the token forward
KERNELS = {**FORWARDS, "split_8": dict(forward="split", backward="split", anchor_every=ANCHOR_EVERY),
           "split_32": dict(forward="split", backward="split", anchor_every=32),
           "token_split_backward": dict(forward="token", backward="split", anchor_every=ANCHOR_EVERY)}


@functools.partial(jax.jit, static_argnames="forward")
def _kernel_a_pass(k_hat, u, a0, document, refresh, w_alpha, w_a, forward="token"):
    def loss(k_hat, u, a0):
        alpha, a = pallas_triton.penalty_pass(k_hat, u, a0, document, refresh, lambda0=LAMBDA0, refresh_magnitude=RHO,
                                              eps=EPS, interpret=True, **KERNELS[forward])
        return jnp.sum(alpha * w_alpha) + jnp.sum(a * w_a), (alpha, a)

    return jax.grad(loss, argnums=(0, 1, 2), has_aux=True)(k_hat, u, a0)


@jax.jit
def _reference_grads(k_hat, u, a0, document, refresh, w_alpha, w_a):
    b, t, h, d = k_hat.shape

    def loss(k_hat, u, a0):
        zeros = jnp.zeros((b, t, h, 1), k_hat.dtype)
        _, (_, a), diag = reference.vla_reference(zeros, k_hat, u, zeros, jnp.zeros((b, h, d, 1), k_hat.dtype), a0,
                                                  document, refresh, lambda0=LAMBDA0, refresh_magnitude=RHO, eps=EPS,
                                                  diagnostics=True)
        return jnp.sum(diag["alpha"] * w_alpha) + jnp.sum(a * w_a), (diag["alpha"], a)

    return jax.grad(loss, argnums=(0, 1, 2), has_aux=True)(k_hat, u, a0)


def _reference_a_pass(k_hat, u, a0, document, refresh, w_alpha, w_a):
    """float64 α̂, A_T and gradients from the token-by-token reference scan (q = v = 0: only the A-pass)."""
    with jax.enable_x64(True):
        wide = [jnp.asarray(np.asarray(x, np.float64)) for x in (k_hat, u, a0, w_alpha, w_a)]
        grads, (alpha, a) = _reference_grads(*wide[:3], document, refresh, *wide[3:])
        return [np.asarray(g) for g in grads], (np.asarray(alpha), np.asarray(a))


A_PASS_CASES = {
    # documents start inside anchor chunks (5, 19, 20: a one-token document), on an anchor edge (16) and on
    # the last, partial chunk (40); refresh offset 1 and initial positions 3 / 0
    "packed_refresh_offset": dict(boundaries=[5, 16, 19, 20, 40], period=5, offset=1, initial_position=[3, 0]),
    "one_document_refresh_every_third": dict(boundaries=[], period=3, offset=2, initial_position=[0, 7]),
    "no_refresh_zero_keys": dict(boundaries=[24], period=0, offset=0, initial_position=[0, 0], zero_rows=(0, 9, 24)),
}


@pytest.mark.parametrize("forward", sorted(KERNELS))
@pytest.mark.parametrize("case", sorted(A_PASS_CASES))
def test_interpret_a_pass_matches_reference_f32(case, forward):
    """α̂, A_T and d/dk̂, d/du, d/dA₀ of the kernels (each forward kernel with the one-kernel backward; the split
    forward and backward; the token forward with the split backward) in float32 vs the float64 reference: rel-RMS
    ≤ 1e-5 (measured, CPU 2026-12-02: ≤ 6.3e-7 token by token, ≤ 6.6e-7 by chunks; 2026-12-08 the split kernels:
    ≤ 6.3e-7)."""
    args, weights = _a_pass_inputs(1, **A_PASS_CASES[case])
    w = [jnp.asarray(x, jnp.float32) for x in weights]
    grads, (alpha, a) = _kernel_a_pass(*args, *w, forward=forward)
    ref_grads, (ref_alpha, ref_a) = _reference_a_pass(*args, *weights)
    assert alpha.dtype == jnp.float32 and a.dtype == jnp.float32
    assert _rel_rms(alpha, ref_alpha) <= 1e-5, _rel_rms(alpha, ref_alpha)
    assert _rel_rms(a, ref_a) <= 1e-5, _rel_rms(a, ref_a)
    # the op symmetrises A₀ before every implementation, so only the symmetric part of dA₀ is defined
    ref_grads[2] = _sym(ref_grads[2])
    for name, g, r in zip(("k_hat", "u", "A0"), grads, ref_grads):
        assert np.all(np.isfinite(np.asarray(g))), name
        assert _rel_rms(g, r) <= 1e-5, (name, _rel_rms(g, r))


@pytest.mark.parametrize("forward", sorted(FORWARDS))
def test_interpret_a_stays_exactly_symmetric(forward):
    """The rank-1 update ŵŵᵀ keeps a symmetric A bitwise symmetric (so the kernel skips the reference's
    symmetrisation), with or without fused multiply-adds (ŵ_i ŵ_j is one exact product either way); so does the
    chunked form's ŴᵀŴ (entries (i, j) and (j, i) sum the same products in the same order)."""
    args, weights = _a_pass_inputs(2, **A_PASS_CASES["packed_refresh_offset"])
    a0 = args[2]
    args = (*args[:2], 0.5 * (a0 + jnp.swapaxes(a0, -1, -2)), *args[3:])
    _, (_, a) = _kernel_a_pass(*args, *(jnp.asarray(x, jnp.float32) for x in weights), forward=forward)
    a = np.asarray(a)
    assert np.array_equal(a, np.swapaxes(a, -1, -2))


# ---------------------------------------------------------------------------------------------------------
# the whole op: A-pass kernel, then the delta rule (on CPU its xla form)

OP_NAMES = ("q", "k", "v", "penalty_key", "S0", "A0")
OP_HYPER = dict(lambda0=LAMBDA0, refresh_period=6, refresh_magnitude=RHO, refresh_offset=2, eps=EPS)


def _op_inputs(dtype):
    b, t, h, d, dv = 1, 37, 2, 16, 16
    rng = np.random.default_rng(3)
    q = np.asarray(jax.nn.elu(rng.normal(size=(b, t, h, d)))) + 1.0
    k = np.asarray(jax.nn.elu(rng.normal(size=(b, t, h, d)))) + 1.0
    v = rng.normal(size=(b, t, h, dv))
    p = rng.normal(size=(b, t, h, d)) + 0.5
    s0 = rng.normal(size=(b, h, d, dv))
    args = [jnp.asarray(x, dtype) for x in (q, k, v, p)] + [jnp.asarray(s0, jnp.float32),
                                                            jnp.asarray(_spd(rng, b, h, d), jnp.float32)]
    segments = jnp.asarray(np.searchsorted([11, 16, 30], np.arange(t), side="right")[None], jnp.int32)
    weights = rng.normal(size=(b, t, h, dv)), rng.normal(size=(b, h, d, dv)), rng.normal(size=(b, h, d, d))
    return args, segments, jnp.asarray([4], jnp.int32), weights


def _op_loss(run, q, k, v, p, s0, a0, segments, initial_position, weights):
    """Σ o⊙w_o + Σ S⊙w_S + Σ A⊙w_A of the op with ``run`` as its implementation (the api's own steps)."""
    hyper = dict(OP_HYPER)
    period, offset = hyper.pop("refresh_period"), hyper.pop("refresh_offset")
    args = api._prepare(q, k, v, p, (s0, a0), segments, initial_position, hyper["lambda0"], period, offset,
                        hyper["eps"])
    o, (s, a) = run(*args, chunk_size=api.resolve_chunk_size(None, period, offset), lambda0=hyper["lambda0"],
                    refresh_magnitude=hyper["refresh_magnitude"], eps=hyper["eps"], operand_dtype=q.dtype)
    w_o, w_s, w_a = weights
    loss = jnp.sum(o.astype(v.dtype).astype(w_o.dtype) * w_o) + jnp.sum(s * w_s) + jnp.sum(a * w_a)
    return loss, (o.astype(v.dtype), s, a)


@pytest.mark.slow  # ~30 s each: the XLA:CPU compile of the delta rule's chunked S-pass and its VJP
@pytest.mark.parametrize("dtype, tol, grad_tol", [(jnp.float32, 1e-5, 1e-5),
                                                  pytest.param(jnp.bfloat16, 1e-2, 2e-2, marks=pytest.mark.extended)])
def test_interpret_op_matches_reference(dtype, tol, grad_tol):
    """o, S, A and the gradients of q, k, v, penalty key, S₀, A₀ vs the float64 reference on the same
    (rounded) inputs, rel-RMS. float32: ≤ 1e-5. bfloat16: the S-pass gets α̂ and k̂ rounded to bfloat16 (the
    GPU kernel's operand dtype) and o is bfloat16, so ~2⁻⁹ relative errors: bounds 1e-2 (values) and 2e-2
    (gradients)."""
    args, segments, initial_position, weights = _op_inputs(dtype)

    def kernel_run(*a, **kw):
        return api._run_pallas_triton(*a, **kw, interpret=True)

    w32 = [jnp.asarray(w, jnp.float32) for w in weights]
    grads, (o, s, a) = jax.jit(jax.grad(lambda *x: _op_loss(kernel_run, *x, segments, initial_position, w32),
                                        argnums=tuple(range(6)), has_aux=True))(*args)
    with jax.enable_x64(True):
        wide = [jnp.asarray(np.asarray(x.astype(jnp.float32)), jnp.float64) for x in args]
        ref_grads, (ref_o, ref_s, ref_a) = jax.grad(
            lambda *x: _op_loss(api._run_reference, *x, segments, initial_position, weights),
            argnums=tuple(range(6)), has_aux=True)(*wide)
    assert o.dtype == dtype and s.dtype == jnp.float32 and a.dtype == jnp.float32
    for name, got, want in (("o", o.astype(jnp.float32), ref_o), ("S", s, ref_s), ("A", a, ref_a)):
        assert _rel_rms(got, want) <= tol, (name, _rel_rms(got, want))
    for name, g, r in zip(OP_NAMES, grads, ref_grads):
        assert g.dtype == args[OP_NAMES.index(name)].dtype, name
        g = np.asarray(g.astype(jnp.float32))
        assert np.all(np.isfinite(g)), name
        assert _rel_rms(g, r) <= grad_tol, (name, _rel_rms(g, r))


# ---------------------------------------------------------------------------------------------------------
# dispatch and lowering


def _call(**kw):
    base = dict(batch=8, length=4096, heads=12, key_dim=64, value_dim=64, dtype=jnp.dtype(jnp.bfloat16),
                has_penalty_key=True, has_initial_state=False, has_segments=True, chunk_size=20, refresh_period=20,
                backend="gpu")
    base.update(kw)
    return api.VLACall(**base)


def test_supports():
    assert pallas_triton.supports(_call()) is None
    assert pallas_triton.supports(_call(key_dim=128, dtype=jnp.dtype(jnp.float32))) is None
    for bad in (dict(backend="cpu"), dict(backend="tpu"), dict(key_dim=96), dict(key_dim=8), dict(key_dim=256),
                dict(dtype=jnp.dtype(jnp.float64))):
        reason = pallas_triton.supports(_call(**bad))
        assert isinstance(reason, str) and reason, bad


def test_auto_takes_the_kernel_on_gpu_only_and_explicit_request_names_the_reason():
    q = jnp.ones((1, 8, 1, 16), jnp.float32)
    assert api.TABLE.choose("auto", _call(backend="cpu")).name == "xla"
    assert api.TABLE.choose("auto", _call()).name == "pallas_triton"  # a GPU call
    assert api.TABLE.choose("auto", _call(key_dim=96)).name == "xla"  # a head dim the kernel refuses
    assert api.TABLE.choose("pallas_triton", _call()).name == "pallas_triton"
    # the split A-pass kernels: opt-in by name, the same op otherwise
    split = api.TABLE.choose("pallas_triton_split", _call())
    assert split.run.func is api._run_pallas_triton
    assert split.run.keywords == {"forward": "split", "backward": "split"}
    with pytest.raises(ValueError, match="implementation='pallas_triton'.*GPU only"):
        api.vla(q, q, q, implementation="pallas_triton")


def test_config_checks():
    with pytest.raises(ValueError, match="anchor_every=48"):
        pallas_triton.make_config(64, lambda0=0.1, refresh_magnitude=1e-3, anchor_every=48)
    with pytest.raises(ValueError, match="forward='blocked'.*'token', 'chunked' or 'split'"):
        pallas_triton.make_config(64, lambda0=0.1, refresh_magnitude=1e-3, forward="blocked")
    with pytest.raises(ValueError, match="backward='chunked'.*'token' or 'split'"):
        pallas_triton.make_config(64, lambda0=0.1, refresh_magnitude=1e-3, backward="chunked")
    with pytest.raises(ValueError, match="chunk_rows=8; expected a power of two >= 16"):
        pallas_triton.make_config(64, lambda0=0.1, refresh_magnitude=1e-3, chunk_rows=8)
    flags = pallas_triton.token_flags(_documents(1, 6, [2, 5]), jnp.asarray([[0, 1, 0, 0, 1, 1]], bool))
    assert flags.tolist() == [[0, 2, 1, 0, 2, 3]]  # RESET = 1 at document starts after t = 0, REFRESH = 2


@pytest.mark.parametrize("forward, backward, calls", [("token", "token", 2), ("chunked", "token", 2),
                                                     ("split", "split", 4)])
def test_lowers_for_cuda_on_cpu(forward, backward, calls):
    """Forward and backward lower to one Triton custom call each for CUDA, the split backward to two (Triton's
    shape and op rules: the lax.cond around the replay, scalar flags, 1-D vectors; the chunked forward's masked
    tile loads at a dynamic row, its while loop and its f32 dots; the replay's anchor-block grid)."""
    s = jax.ShapeDtypeStruct
    b, t, h, d = 1, 200, 2, 64
    specs = [s((b, t, h, d), jnp.float32)] * 2 + [s((b, h, d, d), jnp.float32), s((b, t), jnp.int32),
                                                  s((b, t), jnp.bool_)]

    def loss(k_hat, u, a0, document, refresh):
        alpha, a = pallas_triton.penalty_pass(k_hat, u, a0, document, refresh, lambda0=0.1, refresh_magnitude=1e-3,
                                              eps=1e-4, forward=forward, backward=backward)
        return jnp.sum(alpha) + jnp.sum(a)

    text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(*specs).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == calls  # forward (and its readout); backward (or adjoint and replay)


# {backend}: pallas_triton | pallas_tpu; {hyper}: that backend's extra options (filled by run_per_shard_script)
PER_SHARD_SCRIPT = textwrap.dedent("""
    import os
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    import jax, jax.numpy as jnp, numpy as np
    from mixerlab.pallas_kernels.vla import api, {backend}
    mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(2, 2), ("data", "tensor"))
    rng = np.random.default_rng(0)
    b, t, h, d = 4, 21, 2, 16
    k_hat, u = (api.normalize(jnp.asarray(rng.normal(size=(b, t, h, d)) + 0.5, jnp.float32), 1e-4) for _ in range(2))
    a0 = jnp.broadcast_to(jnp.eye(d, dtype=jnp.float32) * 10.0, (b, h, d, d))
    document = jnp.asarray(np.cumsum(rng.random((b, t)) < 0.15, axis=1), jnp.int32)
    refresh = jnp.asarray(rng.random((b, t)) < 0.2)
    w_alpha, w_a = (jnp.asarray(rng.normal(size=s), jnp.float32) for s in ((b, t, h, d), (b, h, d, d)))
    hyper = dict(lambda0=0.1, refresh_magnitude=0.05, eps=1e-4, interpret=True{hyper})

    def loss(run, k_hat, u, a0):
        alpha, a = run(k_hat, u, a0, document, refresh, **hyper)
        return jnp.sum(alpha * w_alpha) + jnp.sum(a * w_a)

    grad = lambda run: jax.jit(jax.grad(lambda *x: loss(run, *x), (0, 1, 2)))(k_hat, u, a0)
    want = grad({backend}.penalty_pass)
    with jax.set_mesh(mesh):
        got = grad(api.per_shard_a_pass({backend}.penalty_pass, h))
    for g, e in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(e), rtol=1e-5, atol=1e-6)
    print("ok")
""")


def test_per_shard_a_pass_under_a_mesh_matches_unsharded():
    """Under a 2 × 2 (data, tensor) mesh of CPU devices the A-pass kernels run per shard as the op runs them
    (``api.per_shard_a_pass``: batch over "data", heads over "tensor") and give the unsharded gradients of k̂,
    u and A₀ (interpret mode)."""
    run_per_shard_script("pallas_triton", ", anchor_every=8")


def run_per_shard_script(backend, hyper):
    """Runs PER_SHARD_SCRIPT for one A-pass backend in a fresh process with 4 CPU devices."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=root, JAX_PLATFORMS="cpu")
    script = PER_SHARD_SCRIPT.replace("{backend}", backend).replace("{hyper}", hyper)
    run = subprocess.run([sys.executable, "-c", script], cwd=root, env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stdout[-2000:] + run.stderr[-4000:]


# ---------------------------------------------------------------------------------------------------------
# GPU only


gpu = pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a CUDA GPU")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype, tol, grad_tol", [(jnp.float32, 5e-3, 2e-2), (jnp.bfloat16, 3e-2, 6e-2)])
def test_gpu_op_matches_reference(dtype, tol, grad_tol):
    """The compiled op (A-pass kernel + the delta rule's Triton kernel, TF32/bf16 tensor cores) vs the float64
    reference; the A-pass itself has no tensor-core products, so A is held to 1e-4."""
    b, t, h, d = 2, 300, 4, 64
    rng = np.random.default_rng(5)
    q, k = (jnp.asarray(np.asarray(jax.nn.elu(rng.normal(size=(b, t, h, d)))) + 1.0, dtype) for _ in range(2))
    v = jnp.asarray(rng.normal(size=(b, t, h, d)), dtype)
    p = jnp.asarray(rng.normal(size=(b, t, h, d)) + 0.5, dtype)
    segments = jnp.asarray(np.searchsorted([70, 128, 200], np.arange(t), side="right")[None].repeat(b, 0), jnp.int32)
    w_o, w_s, w_a = (jnp.asarray(rng.normal(size=sh), jnp.float32) for sh in ((b, t, h, d), (b, h, d, d), (b, h, d, d)))

    def loss(impl, q, k, v, p):
        o, (s, a) = api.vla(q, k, v, penalty_key=p, segment_ids=segments, implementation=impl)
        return jnp.sum(o.astype(jnp.float32) * w_o) + jnp.sum(s * w_s) + jnp.sum(a * w_a), (o, s, a)

    grads, (o, s, a) = jax.jit(jax.grad(lambda *x: loss("pallas_triton", *x), argnums=(0, 1, 2, 3),
                                        has_aux=True))(q, k, v, p)
    with jax.enable_x64(True):
        wide = [jnp.asarray(np.asarray(x.astype(jnp.float32)), jnp.float64) for x in (q, k, v, p)]
        ref_grads, (ref_o, ref_s, ref_a) = jax.jit(jax.grad(lambda *x: loss("reference", *x), argnums=(0, 1, 2, 3),
                                                            has_aux=True))(*wide)
    assert _rel_rms(a, ref_a) <= 1e-4, _rel_rms(a, ref_a)
    for name, got, want in (("o", o.astype(jnp.float32), ref_o), ("S", s, ref_s)):
        assert _rel_rms(got, want) <= tol, (name, _rel_rms(got, want))
    for name, g, r in zip(("q", "k", "v", "penalty_key"), grads, ref_grads):
        assert _rel_rms(g.astype(jnp.float32), r) <= grad_tol, (name, _rel_rms(g.astype(jnp.float32), r))
