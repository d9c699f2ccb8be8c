"""The short-convolution op (pallas_kernels/short_conv/): the Pallas-Triton kernels in interpret mode on CPU
against the float64 reference — y, dx and dW with and without packed segments, SiLU on and off, T and C that
are not multiples of the blocks, T < K, kernel sizes 2–4, float32 and bfloat16 — plus dispatch and argument
checks. GPU (``-m gpu``, skipped elsewhere): the compiled kernels at a medium shape.

Tolerances, against float64 on the same rounded inputs (|y|, |dx| = O(1)–O(10), |dW| = O(10)–O(100)):
float32 atol 5e-5 (float32 sums of ≤ K² products; dW sums ≤ 600 tokens here); bfloat16 x, y and dx rtol 1e-2
+ atol 1e-2 (one bfloat16 rounding of the stored output, half an ulp = 2^-9 relative, plus float32 sums); dW
with bfloat16 inputs, and on the GPU (4000 tokens per channel, approximate exp) in both dtypes, rtol 1e-4 +
atol 1e-4 (float32 partial sums of float32 products: dW is never rounded to bfloat16).
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from delta_rule_cases import x64
from mixerlab.pallas_kernels.short_conv import api, pallas_triton, reference

SMALL_BLOCKS = dict(block_t=16, block_c=32, bwd_block_t=8, bwd_block_c=32, bwd_steps=4)  # many programs, edges


def _inputs(seed, b, t, c, k, segments):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(b, t, c)).astype(np.float32)
    w = rng.normal(size=(k, c)).astype(np.float32)
    cotangent = rng.normal(size=(b, t, c)).astype(np.float32)
    # short documents (mean length 6) so that most windows of K tokens see a boundary; ids restart per row
    seg = np.cumsum(rng.random((b, t)) < 1 / 6, axis=1).astype(np.int32) if segments else None
    return x, w, cotangent, seg


def _value_and_grads(run, x, w, seg, cotangent, activation, out_dtype):
    seg = None if seg is None else jnp.asarray(seg)

    def loss(x, w):
        y = run(x, w, seg, activation, out_dtype)
        return jnp.sum(y.astype(cotangent.dtype) * cotangent), y

    (_, y), (dx, dw) = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(x, w)
    return y, dx, dw


def _f64(arrays):
    return [np.asarray(jnp.asarray(a, jnp.float32) if a.dtype == jnp.bfloat16 else a, np.float64) for a in arrays]


def _reference(x, w, seg, cotangent, activation):
    """float64 y, dx, dW of the reference (autodiff) on the inputs as given (already rounded to their dtype)."""
    with x64():
        wide = lambda a: jnp.asarray(np.asarray(a, np.float64))  # noqa: E731
        return _f64(_value_and_grads(reference.causal_conv_reference, wide(x), wide(w), seg, wide(cotangent),
                                     activation, jnp.float64))


def _kernel(x, w, seg, cotangent, activation, dtype, **config):
    run = lambda x, w, seg, act, out: pallas_triton.run(x, w, seg, act, out, interpret=True, **config)  # noqa
    return _f64(_value_and_grads(run, jnp.asarray(x, dtype), jnp.asarray(w), seg, jnp.asarray(cotangent),
                                 activation, dtype))


F32_TOL = dict(rtol=0, atol=5e-5)
BF16_TOL = dict(rtol=1e-2, atol=1e-2)
DW_TOL = dict(rtol=1e-4, atol=1e-4)


def _check(got, want, tol, dw_tol=None):
    for name, g, e in zip(("y", "dx", "dW"), got, want):
        assert g.shape == e.shape, name
        np.testing.assert_allclose(g, e, err_msg=name, **(dw_tol if name == "dW" and dw_tol else tol))


@pytest.mark.parametrize("b, t, c, k, activation, segments, config", [
    (2, 37, 96, 4, True, True, {}),               # default blocks: edge blocks in T and C, one backward group
    (2, 300, 200, 3, False, True, SMALL_BLOCKS),  # 19 × 7 forward blocks, 10 × 7 backward programs; no
    # activation: d is dy, the backward's pass 1 skipped
    (2, 300, 200, 2, True, False, SMALL_BLOCKS),  # no segments
    (1, 3, 5, 4, True, True, {}),                 # T < K: taps that reach before the row's start
])
def test_float32_matches_float64_reference(b, t, c, k, activation, segments, config):
    x, w, cotangent, seg = _inputs(b * t + k, b, t, c, k, segments)
    got = _kernel(x, w, seg, cotangent, activation, jnp.float32, **config)
    _check(got, _reference(x, w, seg, cotangent, activation), F32_TOL)


def test_bfloat16_inputs_match_float64_reference():
    """bf16 x and output, f32 W and accumulation; the reference sees the same bf16-rounded x."""
    x, w, cotangent, seg = _inputs(5, 2, 130, 96, 4, True)
    x = np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32))
    cotangent = np.asarray(jnp.asarray(cotangent, jnp.bfloat16).astype(jnp.float32))
    got = _kernel(x, w, seg, cotangent, True, jnp.bfloat16, **SMALL_BLOCKS)
    _check(got, _reference(x, w, seg, cotangent, True), BF16_TOL, DW_TOL)


def test_segments_isolate_documents():
    """Changing the tokens of one document leaves y of every other document bitwise unchanged (the masks, not
    only the tolerance): row 0 of the kernel with the first document's x replaced by noise."""
    x, w, _, seg = _inputs(9, 1, 64, 32, 4, True)
    first = seg[0] == seg[0, 0]
    noisy = x.copy()
    noisy[0, first] = np.random.default_rng(1).normal(size=noisy[0, first].shape)
    run = lambda x: np.asarray(pallas_triton.run(jnp.asarray(x), jnp.asarray(w), jnp.asarray(seg), True,  # noqa
                                                 jnp.float32, interpret=True, block_t=16, block_c=32))
    assert first.sum() < 64
    np.testing.assert_array_equal(run(x)[0, ~first], run(noisy)[0, ~first])


# ---------------------------------------------------------------------------------------------------------
# dispatch and arguments


def test_auto_takes_xla_on_cpu_and_pallas_triton_is_refused_naming_the_backend():
    x, w, _, seg = _inputs(0, 1, 8, 4, 4, True)
    y = api.causal_conv(jnp.asarray(x), jnp.asarray(w), jnp.asarray(seg), True, jnp.float32)
    want = reference.causal_conv_reference(jnp.asarray(x), jnp.asarray(w), jnp.asarray(seg), True, jnp.float32)
    np.testing.assert_allclose(np.asarray(y), np.asarray(want), atol=1e-6)
    expected = "pallas_triton" if jax.default_backend() == "gpu" else "xla"
    assert api.TABLE.choose("auto", api.validate(jnp.asarray(x), jnp.asarray(w), None, True, jnp.float32)).name \
        == expected
    if jax.default_backend() != "gpu":
        with pytest.raises(ValueError, match="pallas_triton.*GPU only.*'cpu'"):
            api.causal_conv(jnp.asarray(x), jnp.asarray(w), None, True, jnp.float32, implementation="pallas_triton")


@pytest.mark.parametrize("args, match", [
    (dict(w=np.zeros((4, 5), np.float32)), r"'w'.*shape \[K, C=4\]"),
    (dict(x=np.zeros((2, 8), np.float32)), r"'x'.*rank-3"),
    (dict(seg=np.zeros((1, 7), np.int32)), r"'segment_ids'.*\[B=1, T=8\]"),
    (dict(activation="silu"), r"'activation'.*True \(SiLU\)"),
    (dict(out_dtype=jnp.int32), r"'out_dtype'.*floating"),
])
def test_bad_arguments_name_the_argument(args, match):
    x, w, _, seg = _inputs(0, 1, 8, 4, 4, True)
    call = dict(x=x, w=w, seg=seg, activation=True, out_dtype=jnp.float32) | args
    with pytest.raises(ValueError, match=match):
        api.causal_conv(jnp.asarray(call["x"]), jnp.asarray(call["w"]), jnp.asarray(call["seg"]),
                        call["activation"], call["out_dtype"])


@pytest.mark.parametrize("segments, activation, calls", [(True, True, 3), (False, True, 3), (True, False, 2)])
def test_forward_and_backward_lower_to_triton_calls_for_cuda_on_cpu(segments, activation, calls):
    """The Pallas-to-Triton lowering accepts the kernels (power-of-two blocks, gathers, masks, the backward's
    loop) at an odd shape: the forward, the backward's pass for d (only with the activation) and its pass for dx
    and dW."""
    s = jax.ShapeDtypeStruct
    specs = [s((2, 300, 200), jnp.bfloat16), s((4, 200), jnp.float32)] + ([s((2, 300), jnp.int32)] if segments else [])

    def loss(x, w, *seg):
        y = pallas_triton.run(x, w, seg[0] if seg else None, activation, jnp.bfloat16)
        return jnp.sum(y.astype(jnp.float32))

    text = jax.jit(jax.grad(loss, argnums=(0, 1))).trace(*specs).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == calls


_PER_SHARD = textwrap.dedent("""
    import os
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    import jax, jax.numpy as jnp, numpy as np
    from mixerlab.pallas_kernels.short_conv import api, xla
    mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(2, 2), ("data", "tensor"))
    rng = np.random.default_rng(0)
    x, r = (jnp.asarray(rng.normal(size=(4, 40, 8)), jnp.float32) for _ in range(2))
    w = jnp.asarray(rng.normal(size=(4, 8)), jnp.float32)
    seg = jnp.asarray(np.cumsum(rng.random((4, 40)) < 0.2, axis=1), jnp.int32)
    f32 = jnp.dtype(jnp.float32)
    want = jax.grad(lambda x, w: jnp.sum(xla.causal_conv(x, w, seg, True, f32) * r), (0, 1))(x, w)
    for channels in (8, 7):  # 8: channels split over "tensor"; 7 does not divide: channels replicated
        loss = lambda x, w: jnp.sum(api._per_shard(xla.causal_conv, channels)(x, w, seg, True, f32) * r)
        with jax.set_mesh(mesh):
            got = jax.jit(jax.grad(loss, (0, 1)))(x, w)
        for g, e in zip(got, want):
            np.testing.assert_allclose(np.asarray(g), np.asarray(e), atol=1e-5)
    print("ok")
""")


@pytest.mark.extended  # the sharded reduction; the kernel-vs-reference tests stay in make test
def test_per_shard_run_sums_dw_over_the_batch_shards():
    """Under a 2 × 2 (data, tensor) mesh of CPU devices the per-shard wrapper the kernels run in gives the
    unsharded dx and dW (shard_map's transpose sums dW over the batch shards), with channels split over
    "tensor" and with channels that do not divide it. The XLA implementation stands in for the kernel."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=root, JAX_PLATFORMS="cpu")
    run = subprocess.run([sys.executable, "-c", _PER_SHARD], cwd=root, env=env, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stdout[-2000:] + run.stderr[-4000:]


def test_config_rejects_blocks_that_are_not_powers_of_two():
    with pytest.raises(ValueError, match="block_c=96.*power of two"):
        pallas_triton.make_config(100, 96, block_c=96)
    with pytest.raises(ValueError, match="unknown config field"):
        pallas_triton.make_config(100, 96, chunk=64)
    cfg = pallas_triton.make_config(4096, 1024)
    assert (cfg.block_t, cfg.block_c, cfg.bwd_block_t, cfg.bwd_block_c, cfg.bwd_steps) == (32, 128, 16, 128, 32)
    cfg = pallas_triton.make_config(37, 96)  # shrunk to T's and C's next power of two
    assert (cfg.block_t, cfg.block_c, cfg.bwd_block_t, cfg.bwd_block_c, cfg.bwd_steps) == (32, 128, 16, 128, 4)
    cfg = pallas_triton.make_config(5, 3)
    assert (cfg.block_t, cfg.block_c, cfg.bwd_block_t, cfg.bwd_block_c, cfg.bwd_steps) == (8, 4, 8, 4, 1)


# ---------------------------------------------------------------------------------------------------------
# GPU only

gpu = pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a CUDA GPU")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype, tol", [(jnp.float32, F32_TOL), (jnp.bfloat16, BF16_TOL)])
def test_gpu_compiled_kernels_match_reference(dtype, tol):
    """The compiled kernels (default blocks) at a medium shape with packed documents, odd T and C. dW sums 4000
    tokens per channel (|dW| ≈ 60): relative tolerance 1e-4 in both dtypes (float32 sums, approximate exp)."""
    x, w, cotangent, seg = _inputs(11, 4, 1000, 384 + 96, 4, True)
    x = np.asarray(jnp.asarray(x, dtype).astype(jnp.float32))
    cotangent = np.asarray(jnp.asarray(cotangent, dtype).astype(jnp.float32))
    run = lambda x, w, seg, act, out: api.causal_conv(x, w, seg, act, out, implementation="pallas_triton")  # noqa
    got = jax.jit(lambda x, w, c: _value_and_grads(run, x, w, seg, c, True, dtype)
                  )(jnp.asarray(x, dtype), jnp.asarray(w), jnp.asarray(cotangent))
    _check(_f64(got), _reference(x, w, seg, cotangent, True), tol, DW_TOL)
