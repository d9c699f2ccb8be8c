"""The attention op: the dense reference against a per-document float64 oracle, and every faster path (dense
XLA; splash attention and GPU flash attention in interpret mode) against the reference — outputs and all
gradients, packed documents (a boundary on a block boundary too), a length that is not a block multiple."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mixerlab.pallas_kernels import attention, common
from mixerlab.pallas_kernels.attention import api, cudnn_packed, pallas_tpu, pallas_triton, reference


def _inputs(seed, b, t, h, d, dtype):
    keys = jax.random.split(jax.random.key(seed), 4)
    q, k, v, d_out = (jax.random.normal(kk, (b, t, h, d), jnp.float32) for kk in keys)
    return [x.astype(dtype) for x in (q, k, v)], d_out.astype(dtype)


def _segments(lengths_per_row):
    return jnp.asarray([np.repeat(np.arange(1, len(ls) + 1), ls) for ls in lengths_per_row], jnp.int32)


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def test_reference_equals_attention_run_per_document():
    """Independent float64 oracle: each document attended on its own with numpy."""
    with jax.enable_x64(True):
        (q, k, v), _ = _inputs(0, 2, 19, 2, 8, jnp.float64)
        lengths = [(7, 12), (19,)]
        out = np.asarray(attention(q, k, v, segment_ids=_segments(lengths), implementation="reference"))
        q, k, v = (np.asarray(x) for x in (q, k, v))
        for row, ls in enumerate(lengths):
            start = 0
            for n in ls:
                sl = slice(start, start + n)
                s = np.einsum("qhd,khd->hqk", q[row, sl], k[row, sl]) / np.sqrt(8)
                s = np.where(np.tril(np.ones((n, n), bool)), s, -np.inf)
                w = np.exp(s - s.max(-1, keepdims=True))
                w /= w.sum(-1, keepdims=True)
                np.testing.assert_allclose(out[row, sl], np.einsum("hqk,khd->qhd", w, v[row, sl]), rtol=1e-12,
                                           atol=1e-12)
                start += n


def _check_against_reference(run, dtype, t, d, lengths, out_tol, grad_tol):
    (q, k, v), d_out = _inputs(1, len(lengths), t, 2, d, dtype)
    seg = _segments(lengths)
    document = common.document_index(seg, len(lengths), t)
    scale = 1.0 / np.sqrt(d)

    def loss(fn):
        return lambda q_, k_, v_: jnp.sum(fn(q_, k_, v_).astype(jnp.float32) * d_out.astype(jnp.float32))

    ref = lambda q_, k_, v_: api._run_reference(q_.astype(jnp.float32), k_.astype(jnp.float32),  # noqa: E731
                                                v_.astype(jnp.float32), document, scale=scale)
    got = lambda q_, k_, v_: run(q_, k_, v_, document, scale=scale)  # noqa: E731
    np.testing.assert_array_less(_rel(jax.jit(got)(q, k, v), ref(q, k, v)), out_tol)
    g_got = jax.jit(jax.grad(loss(got), argnums=(0, 1, 2)))(q, k, v)
    g_ref = jax.grad(loss(ref), argnums=(0, 1, 2))(q, k, v)
    for name, a, b in zip("qkv", g_got, g_ref):
        assert _rel(a, b) < grad_tol, (name, _rel(a, b))


# f32: the kernels accumulate in f32 (interpret mode runs them at f32 "highest" on the CPU) → ~1e-6;
# bf16 operands → ~1e-2 relative.
@pytest.mark.parametrize("dtype, out_tol, grad_tol", [(jnp.float32, 2e-5, 5e-5), (jnp.bfloat16, 2e-2, 3e-2)])
def test_xla_matches_reference(dtype, out_tol, grad_tol):
    _check_against_reference(api._run_xla, dtype, 150, 32, [(64, 50, 36), (150,)], out_tol, grad_tol)


@pytest.mark.parametrize("dtype, out_tol, grad_tol", [(jnp.float32, 2e-5, 5e-5), (jnp.bfloat16, 2e-2, 3e-2)])
def test_splash_interpret_matches_reference(dtype, out_tol, grad_tol):
    """T = 200 pads to 256; documents (128, 60, 12): a boundary exactly on a 128-token block boundary."""
    run = lambda *a, scale: pallas_tpu.run(*a, scale=scale, interpret=True)  # noqa: E731
    _check_against_reference(run, dtype, 200, 128, [(128, 60, 12), (200,)], out_tol, grad_tol)


def test_gpu_flash_interpret_matches_reference():
    """T = 100 pads to 128 (blocks of 64); documents (64, 30, 6): a boundary on a block boundary."""
    run = lambda *a, scale: pallas_triton.run(*a, scale=scale, interpret=True, block_q=64, block_k=64,  # noqa: E731
                                              backward_blocks=(32, 32, 32, 32))
    _check_against_reference(run, jnp.float32, 100, 32, [(64, 30, 6), (100,)], 2e-5, 5e-5)


def test_dispatch_on_cpu_and_errors():
    (q, k, v), _ = _inputs(2, 1, 8, 1, 16, jnp.float32)
    assert api.TABLE.choose("auto", api.AttentionCall(1, 8, 1, 16, jnp.dtype(jnp.float32), "cpu")).name == "xla"
    assert api.TABLE.choose("auto", api.AttentionCall(1, 8, 1, 128, jnp.dtype(jnp.bfloat16), "tpu")).name == \
        "pallas_tpu"
    gpu_call = api.AttentionCall(1, 8, 1, 128, jnp.dtype(jnp.bfloat16), "gpu")
    # cuDNN's packed layout first where this process sees a GPU of compute capability >= 9.0, else flash
    expected = "cudnn_packed" if cudnn_packed.supports(gpu_call) is None else "pallas_triton"
    assert api.TABLE.choose("auto", gpu_call).name == expected
    assert api.TABLE.choose("auto", api.AttentionCall(1, 8, 1, 128, jnp.dtype(jnp.float32), "gpu")).name == "xla"
    with pytest.raises(ValueError, match="pallas_tpu.*needs a TPU backend"):
        attention(q, k, v, implementation="pallas_tpu")
    with pytest.raises(ValueError, match="attention: argument 'segment_ids'"):
        attention(q, k, v, segment_ids=jnp.ones((1, 7), jnp.int32))
    with pytest.raises(ValueError, match="attention: argument 'v'.*head dim 16"):
        attention(q, k, jnp.ones((1, 8, 1, 8)))
    np.testing.assert_allclose(attention(q, k, v), attention(q, k, v, implementation="reference"), rtol=1e-5,
                               atol=1e-6)


def test_document_mask_is_causal_and_per_document():
    mask = np.asarray(reference.document_mask(jnp.asarray([[0, 0, 1, 1]])))[0, 0]
    assert mask.tolist() == [[True, False, False, False], [True, True, False, False],
                             [False, False, True, False], [False, False, True, True]]


@pytest.mark.tpu_compile
@pytest.mark.parametrize("topology", ["v5e:2x2", "v6e:2x2", "v5p:2x2x1"])
def test_splash_compiles_for_tpu(topology):
    """Forward and gradient of the splash path compile with the real Mosaic compiler (T = 1024, D = 128, bf16)."""
    from jax.experimental import topologies
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    topo = topologies.get_topology_desc(topology, "tpu")
    rep = NamedSharding(Mesh(np.array(topo.devices[:1]), ("x",)), P())
    spec = jax.ShapeDtypeStruct((1, 1024, 2, 128), jnp.bfloat16, sharding=rep)
    seg = jax.ShapeDtypeStruct((1, 1024), jnp.int32, sharding=rep)

    def loss(q, k, v, s):
        document = common.document_index(s, 1, 1024)
        return jnp.sum(pallas_tpu.run(q, k, v, document, scale=0.088).astype(jnp.float32))

    compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(spec, spec, spec, seg).compile()
    assert compiled.memory_analysis() is not None


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype, out_tol, grad_tol", [(jnp.float16, 3e-3, 5e-3), (jnp.bfloat16, 2e-2, 3e-2)])
def test_gpu_flash_matches_reference(dtype, out_tol, grad_tol):
    """Compiled on the GPU: T = 300 pads to 384; a document boundary on a block boundary."""
    _check_against_reference(pallas_triton.run, dtype, 300, 128, [(128, 100, 72), (300,)], out_tol, grad_tol)


def test_cudnn_packed_segment_layout():
    """Offsets/lengths of each document in cuDNN's packed convention (−1 padded), against a numpy count."""
    rows = [[5, 5, 5, 7, 7, 9, 9, 9], [1] * 8, [0, 1, 2, 3, 3, 3, 3, 4]]
    seqlen, offsets, count = cudnn_packed.segment_layout(jnp.asarray(rows, jnp.int32), 5)
    assert count.tolist() == [3, 1, 5]
    assert seqlen.tolist() == [[3, 2, 3, -1, -1], [8, -1, -1, -1, -1], [1, 1, 1, 4, 1]]
    assert offsets.tolist() == [[0, 3, 5, -1, -1, -1], [0, -1, -1, -1, -1, -1], [0, 1, 2, 3, 7, -1]]
    for row, lengths, starts in zip(rows, seqlen.tolist(), offsets.tolist()):  # the segments tile the row
        kept = [n for n in lengths if n >= 0]
        assert sum(kept) == len(row) and starts[:len(kept)] == list(np.cumsum([0] + kept[:-1]))
    _, _, count = cudnn_packed.segment_layout(jnp.asarray(rows, jnp.int32), 2)
    assert int(count.max()) == 5  # > 2: run() takes the flash kernel for such a batch


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype, out_tol, grad_tol", [(jnp.float16, 3e-3, 5e-3), (jnp.bfloat16, 2e-2, 3e-2)])
@pytest.mark.parametrize("max_documents", [64, 2])  # 2 < 3 documents: the lax.cond fallback to flash attention
def test_gpu_cudnn_packed_matches_reference(dtype, out_tol, grad_tol, max_documents):
    run = lambda *a, scale: cudnn_packed.run(*a, scale=scale, max_documents=max_documents)  # noqa: E731
    _check_against_reference(run, dtype, 300, 128, [(128, 100, 72), (300,)], out_tol, grad_tol)
