"""Shared pieces of the GLA and HGRN2 layer tests (tests/mixers/test_gla_layer.py, test_hgrn2_layer.py): the
no-erase recurrence restated token by token in numpy float64, the layer's parameters as float64 arrays, decode
and prefill loops, and the TPU compile of a layer's forward + backward through libtpu."""
from __future__ import annotations

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mixerlab import mixers, pallas_kernels  # noqa: F401  (mixers: registers every mixer)
from mixerlab.mixers import registry
from mixerlab.mixers.base import MixerSpec

_PALLAS_TESTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "pallas_kernels")
if _PALLAS_TESTS not in sys.path:
    sys.path.insert(0, _PALLAS_TESTS)

from tpu_topologies import one_device_mesh  # noqa: E402

D = 64
# chunk 8 over leaves of 4: T = 37 spans five chunks, documents start inside chunks and at their edges
CHUNKING = dict(chunk_size=8, leaf_size=4)
# a row of three documents, the first id reused for the third (a new document), and a row of one document
SEG_LENGTHS = ((11, 16, 10), (37,))
SEG_IDS = ((1, 2, 1), (1,))


def spec(H=2, Dk=16, Dv=32, layer_index=1, num_layers=2, dtype=jnp.float32, d=D) -> MixerSpec:
    return MixerSpec(d_model=d, num_heads=H, head_dim=Dk, value_head_dim=Dv, layer_index=layer_index,
                     num_layers=num_layers, dtype=dtype)


def build(name, layer_spec=None, seed=0, **options):
    opts = registry.get(name).options(**{**CHUNKING, **options})
    return registry.build(name, layer_spec or spec(), opts, rngs=nnx.Rngs(seed))


def params64(layer) -> dict[str, np.ndarray]:
    """Every parameter as float64 numpy, keyed by its dotted path (``q_proj.kernel``, ``gk_proj.bias``...)."""
    return {".".join(str(p) for p in path): np.asarray(v[...], np.float64)
            for path, v in nnx.to_flat_state(nnx.state(layer, nnx.Param))}


def x_input(B, T, seed=0, dtype=jnp.float32, d=D):
    return jax.random.normal(jax.random.key(100 + seed), (B, T, d), jnp.float32).astype(dtype)


def packed_segments(T=37):
    """segment ids [2, T] (row 0: three documents, id 1 reused) and positions restarting at every document."""
    seg, pos = [], []
    for lengths, ids in zip(SEG_LENGTHS, SEG_IDS):
        assert sum(lengths) == T
        seg.append(np.repeat(ids, lengths))
        pos.append(np.concatenate([np.arange(n) for n in lengths]))
    return jnp.asarray(np.stack(seg), jnp.int32), jnp.asarray(np.stack(pos), jnp.int32)


def naive_recurrence(q_hat, k_hat, v_hat, lam, segment_ids=None):
    """S_t = Diag(exp λ_t) S_{t−1} + k̂_tᵀ v̂_t (state key-major [d_k, d_v] per head, zero at every document
    start), o_t = q̂_t S_t; numpy float64. Returns (o [B,T,H,Dv], final state [B,H,Dk,Dv])."""
    q_hat, k_hat, v_hat, lam = (np.asarray(a, np.float64) for a in (q_hat, k_hat, v_hat, lam))
    B, T, H, Dk = q_hat.shape
    seg = np.ones((B, T), np.int64) if segment_ids is None else np.asarray(segment_ids)
    S = np.zeros((B, H, Dk, v_hat.shape[-1]))
    out = np.zeros(v_hat.shape)
    for t in range(T):
        for b in range(B):
            if t > 0 and seg[b, t] != seg[b, t - 1]:
                S[b] = 0.0
        S = np.exp(lam[:, t])[..., None] * S + k_hat[:, t][..., None] * v_hat[:, t][..., None, :]
        out[:, t] = np.einsum("bhk,bhkv->bhv", q_hat[:, t], S)
    return out, S


def log_sigmoid(z):
    return -np.logaddexp(0.0, -z)


def rms_norm(x, scale, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * scale


def silu(z):
    return z / (1.0 + np.exp(-z))


def max_rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


_FORWARD = nnx.jit(lambda m, x, s: m(x, segment_ids=s))
_PREFILL = nnx.jit(lambda m, x, s: m.prefill(x, segment_ids=s))
_DECODE = nnx.jit(lambda m, x, c, p: m.decode(x, c, p))
_EXTEND = nnx.jit(lambda m, x, c, p: m.extend(x, c, p))


@nnx.jit
def _op_on_layer_inputs(layer, x, seg):
    f = layer._features(x, *layer._project(x))
    return f, pallas_kernels.delta_rule(f.q, f.k, f.v, erase_key=None, log_decay=f.log_decay, segment_ids=seg,
                                        **CHUNKING)


def forward(layer, x, seg=None):
    return _FORWARD(layer, x, seg)


def prefill(layer, x, seg=None):
    return _PREFILL(layer, x, seg)


def decode_all(layer, x, positions, cache=None):
    cache = layer.init_cache(x.shape[0]) if cache is None else cache
    outs = []
    for t in range(x.shape[1]):
        y, cache = _DECODE(layer, x[:, t:t + 1], cache, positions[:, t])
        outs.append(y[:, 0])
    return jnp.stack(outs, 1), cache


def extend(layer, x, cache, positions):
    return _EXTEND(layer, x, cache, positions)


def op_on_layer_inputs(layer, x, seg=None):
    """The op's inputs as the layer builds them (``Features``) and the op's (output, final state) on them."""
    return _op_on_layer_inputs(layer, x, seg)


def compile_layer_for_tpu(gen, name, layer_spec, B=1, T=512, **options):
    """The layer's forward + backward (loss = Σ y², gradients for the parameters and x) compiled for one chip of
    ``gen`` through libtpu, traced under that chip's mesh as the trainer traces its step (so the op's "auto" picks
    the Pallas TPU kernel); returns the compiled program's text."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    layer = registry.build(name, layer_spec, registry.get(name).options(**options), rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(layer)
    mesh = one_device_mesh(gen)
    rep = NamedSharding(mesh, P())

    def loss(params, x, seg):
        y = nnx.merge(graphdef, params)(x, segment_ids=seg)
        return jnp.sum(y.astype(jnp.float32) ** 2)

    sds = lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=rep)  # noqa: E731
    x = jax.ShapeDtypeStruct((B, T, layer_spec.d_model), layer_spec.dtype, sharding=rep)
    specs = (jax.tree.map(sds, params), x, jax.ShapeDtypeStruct((B, T), jnp.int32, sharding=rep))
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(*specs).compile().as_text()


def one_train_step(tmp_path, mixer, *overrides):
    """(loss, grad norm) of one train step of configs/tiny.yaml with one ``mixer`` block on the embedded sample."""
    from mixerlab.training import data as data_lib
    from mixerlab.training.config import load_config
    from mixerlab.training.loop import Trainer
    from mixerlab.training.tokenizer import load_tokenizer

    cfg = load_config("configs/tiny.yaml", [f"train.output_dir={tmp_path / mixer}", f"model.mixer={mixer}",
                                            "model.num_layers=1", "train.batch_size=2", "data.seq_len=32",
                                            *overrides])
    tok = load_tokenizer(cfg.data.tokenizer.kind, cfg.data.tokenizer.path)
    trainer = Trainer(cfg, tok.vocab_size)
    trainer.initialize()
    batch = trainer.global_batch(next(data_lib.train_iterator(cfg.data, tok, global_batch_size=2, seed=0)))
    _, _, metrics = trainer.train_step(trainer.params, trainer.opt_state, batch)
    return float(metrics["loss"]), float(metrics["grad_norm"])
