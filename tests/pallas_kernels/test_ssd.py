"""The SSD op (pallas_kernels/ssd): grouped scalar-decay linear attention, Mamba-2's SSD layer.

* the GPU kernels (``pallas_triton``, run by the Pallas interpreter on the CPU) against the float64 token-by-token
  oracle: outputs, final states and the gradients of q, k, v, λ and the initial state, on odd lengths, packed
  documents (a reused id), one and two groups, several N and P, float32 and bfloat16;
* the kernels against fla's naive scalar-decay recurrence, document by document (where torch and fla are);
* the delta-rule path ("xla": q, k repeated per head) against the oracle in float64;
* the kernels lowered for CUDA on the CPU (the pallas_calls Triton receives), the refusals and the argument errors.
Tolerances (relative to the largest entry of the oracle's array): float32 2e-5, bfloat16 2e-2, float64 1e-10.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mixerlab.pallas_kernels import common, ssd
from mixerlab.pallas_kernels.ssd import api, pallas_triton, reference

# (batch, length, groups, heads, N, P, chunk)
SHAPES = [(2, 37, 2, 4, 16, 32, 16), (2, 50, 1, 2, 32, 16, 32)]
TOL = {jnp.float32: 2e-5, jnp.bfloat16: 2e-2}


def inputs(b, t, g, h, n, p, seed=0):
    r = np.random.default_rng(seed)
    q, k = (r.normal(size=(b, t, g, n)) * 0.5 for _ in range(2))
    v = r.normal(size=(b, t, h, p))
    log_decay = -np.exp(r.normal(size=(b, t, h)) - 1.0)
    state = r.normal(size=(b, h, n, p)) * 0.3
    seg = np.stack([np.array([1] * 9 + [2] * 13 + [1] * (t - 22)), np.full(t, 3)])[:b].astype(np.int32)
    return (q, k, v, log_decay, state), seg


def rel_err(got, want):
    want = np.asarray(want, np.float64)
    return float(np.max(np.abs(np.asarray(got, np.float64) - want)) / np.max(np.abs(want)))


def loss_and_grads(run, args, weights):
    """((out, final), gradients of Σ out·w₀ + Σ final·w₁ with respect to the five inputs), one forward."""
    def loss(*a):
        out, final = run(*a)
        acc = jnp.float64 if out.dtype == jnp.float64 else jnp.float32
        return jnp.sum(out.astype(acc) * weights[0]) + jnp.sum(final * weights[1]), (out, final)

    grads, out = jax.grad(loss, argnums=tuple(range(5)), has_aux=True)(*args)
    return out, grads


def oracle(args, seg, weights):
    with jax.enable_x64(True):
        a = [jnp.asarray(x, jnp.float64) for x in args]
        document = common.document_index(jnp.asarray(seg), *seg.shape)
        run = lambda *x: reference.ssd_reference(*x, document)  # noqa: E731
        (out, final), grads = loss_and_grads(run, a, [jnp.asarray(w, jnp.float64) for w in weights])
        return [np.asarray(x) for x in (out, final, *grads)]


def check_kernels_against_the_oracle(args, seg, dtype, tol, **run_options):
    """The kernels' outputs, final state and five gradients within ``tol`` of the float64 oracle."""
    b, t, h, p = args[2].shape
    n = args[0].shape[-1]
    r = np.random.default_rng(1)
    weights = (r.normal(size=(b, t, h, p)), r.normal(size=(b, h, n, p)))
    want = oracle(args, seg, weights)
    document = common.document_index(jnp.asarray(seg), b, t)
    cast = [jnp.asarray(x, dtype) for x in args[:3]] + [jnp.asarray(x, jnp.float32) for x in args[3:]]

    def run(*a):
        return pallas_triton.run(*a, document, **run_options)

    (out, final), grads = jax.jit(lambda *a: loss_and_grads(run, a, [jnp.asarray(w, jnp.float32) for w in weights]))(
        *cast)
    assert out.dtype == dtype and final.dtype == jnp.float32
    for name, got, exp in zip(("out", "final", "dq", "dk", "dv", "dλ", "dS0"), (out, final, *grads), want):
        assert rel_err(got, exp) < tol, name


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("shape", SHAPES, ids=["G2H4N16P32", "G1H2N32P16"])
def test_triton_kernels_match_the_f64_oracle(shape, dtype):
    b, t, g, h, n, p, chunk = shape
    args, seg = inputs(b, t, g, h, n, p)
    check_kernels_against_the_oracle(args, seg, dtype, TOL[dtype], chunk_size=chunk, interpret=True)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_split_forward_matches_the_f64_oracle_and_the_one_kernel_forward(dtype):
    """``split_forward``: the state scan, then every chunk's outputs at once (grid (H, chunks, B)); against the
    oracle (outputs, final state, all gradients), and the same outputs as the one-kernel forward (S₀ enters Q S₀
    rounded to the operand dtype either way)."""
    b, t, g, h, n, p, chunk = SHAPES[0]
    args, seg = inputs(b, t, g, h, n, p)
    check_kernels_against_the_oracle(args, seg, dtype, TOL[dtype], chunk_size=chunk, interpret=True,
                                     split_forward=True)
    document = common.document_index(jnp.asarray(seg), b, t)
    cast = [jnp.asarray(x, dtype) for x in args[:3]] + [jnp.asarray(x, jnp.float32) for x in args[3:]]
    one, two = (pallas_triton.run(*cast, document, chunk_size=chunk, interpret=True, split_forward=split)
                for split in (False, True))
    for a, c in zip(one, two):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(c, np.float32), rtol=1e-6, atol=1e-6)


def test_heads_then_batch_grid_with_unequal_b_and_h():
    """The (H, B) grid (a row's heads side by side in launch order, for L2 reuse of the shared q and k) maps every
    block to its row and head: B = 3 and H = 4 differ, so a swapped index map would read another row or head."""
    args, seg = inputs(3, 40, 2, 4, 16, 32, seed=11)
    seg = np.concatenate([seg, np.repeat([[4, 5]], [20, 20])[None]]).astype(np.int32)  # inputs gives two rows
    check_kernels_against_the_oracle(args, seg, jnp.float32, TOL[jnp.float32], chunk_size=16, interpret=True)


def test_documents_starting_on_chunk_starts_with_weak_decay():
    """Boundaries exactly at chunk starts (the carried-in document and γ at a chunk's first token) and λ ≈ −0.01
    per token, so a chunk's end decay (≈ e^−0.16) carries the state and its gradient across chunks."""
    b, t, g, h, n, p, chunk = 2, 64, 1, 2, 16, 16, 16
    args, _ = inputs(b, t, g, h, n, p, seed=7)
    args = (*args[:3], np.full((b, t, h), -0.01) * np.random.default_rng(8).uniform(0.5, 1.5, (b, t, h)), args[4])
    seg = np.stack([np.repeat([1, 2, 3], [16, 16, 32]), np.repeat([5, 6], [32, 32])]).astype(np.int32)
    check_kernels_against_the_oracle(args, seg, jnp.float32, TOL[jnp.float32], chunk_size=chunk, interpret=True)


def test_kernels_match_flas_naive_recurrence_document_by_document():
    """fla's ``naive_recurrent_simple_gla`` (scalar decay per head, scale 1; q, k given per head as group h // (H/G))
    run on each document of a packed row alone — the first from the initial state, the others from zero — against
    the kernels on the packed rows (two groups of two heads, a reused id, T = 37). fla computes in float32."""
    torch = pytest.importorskip("torch")
    naive = pytest.importorskip("fla.ops.simple_gla.naive").naive_recurrent_simple_gla
    b, t, g, h, n, p, chunk = SHAPES[0]
    (q, k, v, lam, state), seg = inputs(b, t, g, h, n, p, seed=5)
    document = common.document_index(jnp.asarray(seg), b, t)
    f32 = [jnp.asarray(x, jnp.float32) for x in (q, k, v, lam, state)]
    out, final = jax.jit(lambda *a: pallas_triton.run(*a, document, chunk_size=chunk, interpret=True))(*f32)
    doc = np.asarray(document)
    t_ = lambda a: torch.from_numpy(np.ascontiguousarray(a, np.float32))  # noqa: E731
    for row in range(b):
        starts = [0, *np.flatnonzero(np.diff(doc[row])) + 1, t]
        for i, (lo, hi) in enumerate(zip(starts[:-1], starts[1:])):
            o_ref, s_ref = naive(t_(np.repeat(q[row:row + 1, lo:hi], h // g, axis=2)),
                                 t_(np.repeat(k[row:row + 1, lo:hi], h // g, axis=2)), t_(v[row:row + 1, lo:hi]),
                                 t_(lam[row:row + 1, lo:hi]), scale=1.0,
                                 initial_state=t_(state[row:row + 1]) if i == 0 else None, output_final_state=True)
            assert rel_err(out[row, lo:hi], o_ref[0].numpy()) < 2e-5, (row, lo, hi)
        assert rel_err(final[row], s_ref[0].numpy()) < 2e-5, row


def test_the_delta_rule_path_matches_the_oracle_in_f64():
    b, t, g, h, n, p, chunk = SHAPES[0]
    args, seg = inputs(b, t, g, h, n, p, seed=2)
    r = np.random.default_rng(3)
    weights = (r.normal(size=(b, t, h, p)), r.normal(size=(b, h, n, p)))
    want = oracle(args, seg, weights)
    with jax.enable_x64(True):
        a = [jnp.asarray(x, jnp.float64) for x in args]

        def run(q, k, v, lam, s0):
            return ssd(q, k, v, log_decay=lam, initial_state=s0, segment_ids=jnp.asarray(seg), chunk_size=chunk,
                       leaf_size=8, implementation="xla")

        (out, final), grads = loss_and_grads(run, a, [jnp.asarray(w, jnp.float64) for w in weights])
        for name, got, exp in zip(("out", "final", "dq", "dk", "dv", "dλ", "dS0"), (out, final, *grads), want):
            assert rel_err(got, exp) < 1e-10, name


def test_without_state_or_segments_the_op_starts_from_zero_and_runs_one_document():
    b, t, g, h, n, p, chunk = SHAPES[1]
    (q, k, v, lam, _), _ = inputs(b, t, g, h, n, p, seed=4)
    with jax.enable_x64(True):
        a = [jnp.asarray(x, jnp.float64) for x in (q, k, v, lam)]
        out, final = ssd(*a[:3], log_decay=a[3], chunk_size=chunk, implementation="xla")
        want_out, want_final = reference.ssd_reference(*a, jnp.zeros((b, h, n, p)), jnp.zeros((b, t), jnp.int32))
        assert rel_err(out, want_out) < 1e-10 and rel_err(final, want_final) < 1e-10


def lowered_gradient_for_cuda(b, t, g, h, n, p, dtype, **overrides):
    """The StableHLO text of the kernels' forward + backward (the gradient of q, k, v, λ, S₀), lowered for CUDA
    on this CPU: operands q, k [B, T, G, N] and v [B, T, H, P] in ``dtype``, λ and the state float32."""
    s = jax.ShapeDtypeStruct
    specs = (s((b, t, g, n), dtype), s((b, t, g, n), dtype), s((b, t, h, p), dtype),
             s((b, t, h), jnp.float32), s((b, h, n, p), jnp.float32), s((b, t), jnp.int32))

    def loss(q, k, v, lam, state, document):
        out, final = pallas_triton.run(q, k, v, lam, state, document, chunk_size=64, **overrides)
        return jnp.sum(out.astype(jnp.float32)) + jnp.sum(final)

    return jax.jit(jax.grad(loss, argnums=tuple(range(5)))).trace(*specs).lower(lowering_platforms=("cuda",)).as_text()


def test_kernels_lower_for_cuda_without_repeating_q_and_k():
    """The forward is one Pallas call and the backward two (the dS scan; the per-chunk gradients on a 3-D grid,
    chunk-sized blocks of q, k, v, λ and the documents, one S₀ and dS per program); q and k enter at their group
    shape (no [B, T, H, N] copy is made: the BlockSpec indexes them by group)."""
    b, t, g, h, n, p = 2, 256, 1, 8, 64, 32
    text = lowered_gradient_for_cuda(b, t, g, h, n, p, jnp.bfloat16)
    for name in ("ssd_forward", "ssd_backward_states", "ssd_backward_chunks"):
        assert text.count(f'"{name}"') >= 1, name
    assert f"tensor<{b}x{t}x{h}x{n}xbf16>" in text  # the per-head dq, dk partials, summed over the group by XLA
    assert f"tensor<{b}x{t}x{h}x{n}xbf16>" not in text.split("ssd_backward")[0]  # the forward never sees them


def test_split_forward_lowers_for_cuda_as_a_scan_and_a_chunk_grid():
    text = lowered_gradient_for_cuda(2, 256, 1, 8, 64, 32, jnp.bfloat16, split_forward=True)
    for name in ("ssd_forward_states", "ssd_forward_chunks", "ssd_backward_states", "ssd_backward_chunks"):
        assert text.count(f'"{name}"') >= 1, name
    assert '"ssd_forward"' not in text


@pytest.mark.parametrize("setting", [None, "highest"], ids=["tf32", "highest"])
def test_float32_kernels_lower_for_cuda_under_either_matmul_precision(setting):
    """float32 operands take the config's matmul precision ("tf32" under JAX's default, "highest" under
    jax.default_matmul_precision("highest")); both must reach dot_general as values it takes."""
    with jax.default_matmul_precision(setting):
        assert '"ssd_backward_chunks"' in lowered_gradient_for_cuda(1, 128, 1, 2, 32, 32, jnp.float32)


def call(**overrides):
    base = dict(batch=2, length=64, heads=32, groups=1, state_dim=128, head_dim=64, dtype=jnp.dtype(jnp.bfloat16),
                has_initial_state=False, has_segments=True, chunk_size=64, leaf_size=16, backend="gpu")
    return api.SsdCall(**{**base, **overrides})


def test_the_kernels_refuse_what_they_cannot_run():
    if pallas_triton.supports(call()) is not None:
        pytest.skip("this JAX has no Pallas-Triton backend")
    assert "GPU only" in pallas_triton.supports(call(backend="cpu"))
    assert "chunk_size=256" in pallas_triton.supports(call(chunk_size=256))
    assert "head_dim=48" in pallas_triton.supports(call(head_dim=48))
    assert "registers" in pallas_triton.supports(call(state_dim=256, head_dim=128))
    assert "float64" in pallas_triton.supports(call(dtype=jnp.dtype(jnp.float64)))
    assert api.TABLE.choose("auto", call(backend="cpu")).name == "xla"
    assert api.TABLE.choose("auto", call()).name == "pallas_triton"  # on the GPU, the SSD kernels first
    assert api.TABLE.choose("auto", call(state_dim=256, head_dim=128)).name == "delta_rule_triton"  # then delta rule
    assert api.TABLE.choose("pallas_triton", call()).name == "pallas_triton"


def test_arguments_are_checked_with_messages_that_name_them():
    (q, k, v, lam, state), _ = inputs(2, 24, 2, 4, 16, 16)
    q, k, v, lam = (jnp.asarray(x, jnp.float32) for x in (q, k, v, lam))
    with pytest.raises(ValueError, match="ssd: argument 'v'.*multiple of the G=2 groups"):
        ssd(q, k, v[:, :, :3], log_decay=lam[:, :, :3])
    with pytest.raises(ValueError, match="ssd: argument 'log_decay'"):
        ssd(q, k, v, log_decay=lam[..., None])
    with pytest.raises(ValueError, match="ssd: argument 'k'.*dtype float32"):
        ssd(q, k.astype(jnp.bfloat16), v, log_decay=lam)
    with pytest.raises(ValueError, match="ssd: argument 'initial_state'"):
        ssd(q, k, v, log_decay=lam, initial_state=jnp.zeros((2, 4, 16, 8)))
    with pytest.raises(ValueError, match="ssd: argument 'log_decay' is outside its domain"):
        ssd(q, k, v, log_decay=-lam)
    with pytest.raises(ValueError, match="implementation='nope'"):
        ssd(q, k, v, log_decay=lam, implementation="nope")


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype, setting, tol", [(jnp.float32, "highest", 1e-4), (jnp.float32, None, 8e-3),
                                                 (jnp.bfloat16, None, 3e-2)], ids=["f32", "tf32", "bf16"])
def test_gpu_compiled_kernels_match_the_f64_oracle(dtype, setting, tol):
    """The compiled kernels at Mamba-2's widths (N 128, P 64), two groups of two heads, T = 150 packed, chunk 64.
    float32 under jax.default_matmul_precision("highest"): 1e-4 (three TF32 passes per matmul); under JAX's
    default, one TF32 pass (10-bit mantissa, 2 bits more than bfloat16): bfloat16's 3e-2 over 4, rounded up
    (the output's error measured on an H100: 6.6e-4)."""
    b, t, g, h, n, p = 2, 150, 2, 4, 128, 64
    args, _ = inputs(b, t, g, h, n, p, seed=5)
    args = (args[0] / 4, args[1] / 4, *args[2:])  # |q·k| ~ 1 at N = 128
    seg = np.stack([np.repeat([1, 2, 1], [40, 70, 40]), np.full(t, 3)]).astype(np.int32)
    with jax.default_matmul_precision(setting):
        check_kernels_against_the_oracle(args, seg, dtype, tol, chunk_size=64)


PER_SHARD_SCRIPT = """
import os
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
import dataclasses, functools
import jax, jax.numpy as jnp, numpy as np
from mixerlab.pallas_kernels import dispatch, ssd
from mixerlab.pallas_kernels.ssd import api, pallas_triton
# the SSD kernels by the interpreter, served for a CPU call (the op wraps every pallas_* implementation per shard)
api.TABLE._impls["pallas_triton"] = dispatch.Implementation(
    "pallas_triton", lambda *a, leaf_size, **kw: pallas_triton.run(*a, interpret=True, **kw), lambda call: None)
mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(2, 2), ("data", "tensor"))
r = np.random.default_rng(0)
b, t, g, h, n, p = 4, 40, 2, 4, 16, 16
q, k = (jnp.asarray(r.normal(size=(b, t, g, n)) * 0.5, jnp.float32) for _ in range(2))
v = jnp.asarray(r.normal(size=(b, t, h, p)), jnp.float32)
lam = jnp.asarray(-np.exp(r.normal(size=(b, t, h)) - 1.0), jnp.float32)
seg = jnp.asarray(np.cumsum(r.random((b, t)) < 0.1, axis=1), jnp.int32)
w = jnp.asarray(r.normal(size=(b, t, h, p)), jnp.float32)

def grads(impl):
    loss = lambda *x: jnp.sum(ssd(*x[:3], log_decay=x[3], segment_ids=seg, chunk_size=16, implementation=impl)[0] * w)
    return jax.jit(jax.grad(loss, (0, 1, 2, 3)))(q, k, v, lam)

want = grads("xla")
with jax.set_mesh(mesh):
    got = grads("pallas_triton")
for a, e in zip(got, want):
    np.testing.assert_allclose(np.asarray(a), np.asarray(e), rtol=2e-5, atol=2e-5)
print("ok")
"""


def test_per_shard_under_a_mesh_splits_groups_and_matches_unsharded():
    """Under a 2 × 2 (data, tensor) mesh of CPU devices the kernels run per shard — batch over "data", the G = 2
    groups (and with them their heads) over "tensor", λ [B, T, H] as ``token_heads`` — and give the unsharded
    gradients of q, k, v and λ (interpret mode, against the delta-rule path)."""
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=root, JAX_PLATFORMS="cpu")
    run = subprocess.run([sys.executable, "-c", PER_SHARD_SCRIPT], cwd=root, env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stdout[-2000:] + run.stderr[-4000:]
