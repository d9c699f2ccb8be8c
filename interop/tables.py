"""Name-and-layout tables: mixerlab parameter path <-> target tensor name, one table per target, as data.

A row is ``(target name, mixerlab path, layout, when)``; ``{i}`` is the layer index. Layouts:
  ``linear``  nnx.Linear kernel [in, out]  <-> torch ``nn.Linear.weight`` [out, in] (a transpose)
  ``copy``    same array, same shape (norm scales, embeddings, A_log, dt_bias, biases)
  ``conv``    ShortConv kernel [K, C] (y_t = sum_i W[K-1-i] x_{t-i}) <-> depthwise ``nn.Conv1d.weight`` [C, 1, K]
              (torch's causal conv with K-1 left padding reads weight[c, 0, j] against x_{t-(K-1)+j}: no flip)
``when`` names a condition of the config (``interop/targets.py`` decides it): the row exists only then.
Every transform is a transpose or reshape, so export -> import is exact bit for bit.
"""
from __future__ import annotations

import numpy as np

# ---- backbones ------------------------------------------------------------------------------------------
# HF transformers LlamaForCausalLM (transformers/models/llama/modeling_llama.py)
LLAMA_BACKBONE = (
    ("model.embed_tokens.weight", "embed.embedding", "copy", None),
    ("model.layers.{i}.input_layernorm.weight", "blocks.{i}.mixer_norm.scale", "copy", None),
    ("model.layers.{i}.post_attention_layernorm.weight", "blocks.{i}.ffn_norm.scale", "copy", None),
    ("model.layers.{i}.mlp.gate_proj.weight", "blocks.{i}.ffn.gate.kernel", "linear", None),
    ("model.layers.{i}.mlp.up_proj.weight", "blocks.{i}.ffn.up.kernel", "linear", None),
    ("model.layers.{i}.mlp.down_proj.weight", "blocks.{i}.ffn.down.kernel", "linear", None),
    ("model.norm.weight", "final_norm.scale", "copy", None),
    ("lm_head.weight", "lm_head.kernel", "linear", "untied"),
)
LLAMA_ATTENTION = (
    ("model.layers.{i}.self_attn.q_proj.weight", "blocks.{i}.mixer.q_proj.kernel", "linear", None),
    ("model.layers.{i}.self_attn.k_proj.weight", "blocks.{i}.mixer.k_proj.kernel", "linear", None),
    ("model.layers.{i}.self_attn.v_proj.weight", "blocks.{i}.mixer.v_proj.kernel", "linear", None),
    ("model.layers.{i}.self_attn.o_proj.weight", "blocks.{i}.mixer.o_proj.kernel", "linear", None),
)

# fla's HF models (fla/models/<name>/modeling_<name>.py: <Name>ForCausalLM -> model.embeddings, model.layers[i]
# .attn_norm/.attn/.mlp_norm/.mlp (GatedMLP), model.norm, lm_head)
FLA_BACKBONE = (
    ("model.embeddings.weight", "embed.embedding", "copy", None),
    ("model.layers.{i}.attn_norm.weight", "blocks.{i}.mixer_norm.scale", "copy", None),
    ("model.layers.{i}.mlp_norm.weight", "blocks.{i}.ffn_norm.scale", "copy", None),
    ("model.layers.{i}.mlp.gate_proj.weight", "blocks.{i}.ffn.gate.kernel", "linear", None),
    ("model.layers.{i}.mlp.up_proj.weight", "blocks.{i}.ffn.up.kernel", "linear", None),
    ("model.layers.{i}.mlp.down_proj.weight", "blocks.{i}.ffn.down.kernel", "linear", None),
    ("model.norm.weight", "final_norm.scale", "copy", None),
    ("lm_head.weight", "lm_head.kernel", "linear", "untied"),
)

_A = "model.layers.{i}.attn."
_M = "blocks.{i}.mixer."
# q/k/v projections, their short convolutions, the output norm and projection: the same names in every fla
# delta-rule layer (fla/layers/{delta_net,gated_deltanet,kda,gdn2}.py)
_FLA_QKVO = (
    (_A + "q_proj.weight", _M + "q_proj.kernel", "linear", None),
    (_A + "k_proj.weight", _M + "k_proj.kernel", "linear", None),
    (_A + "v_proj.weight", _M + "v_proj.kernel", "linear", None),
    (_A + "q_conv1d.weight", _M + "q_conv.kernel", "conv", "short_conv"),
    (_A + "k_conv1d.weight", _M + "k_conv.kernel", "conv", "short_conv"),
    (_A + "v_conv1d.weight", _M + "v_conv.kernel", "conv", "short_conv"),
    (_A + "o_norm.weight", _M + "o_norm.scale", "copy", None),
    (_A + "o_proj.weight", _M + "o_proj.kernel", "linear", None),
)
# f_proj / g_proj are nn.Sequential(Linear(d, r), Linear(r, out)): indices 0 and 1
_FLA_LOW_RANK = (
    (_A + "f_proj.0.weight", _M + "f_proj.down.kernel", "linear", None),
    (_A + "f_proj.1.weight", _M + "f_proj.up.kernel", "linear", None),
    (_A + "g_proj.0.weight", _M + "g_proj.down.kernel", "linear", None),
    (_A + "g_proj.1.weight", _M + "g_proj.up.kernel", "linear", None),
    (_A + "g_proj.1.bias", _M + "g_proj.bias", "copy", None),
    (_A + "A_log", _M + "A_log", "copy", None),
    (_A + "dt_bias", _M + "dt_bias", "copy", None),
)

# softmax layers inside an fla model (its ``attn`` hybrid setting: fla/layers/attn.py ``Attention``)
FLA_ATTENTION = tuple((_A + f"{n}_proj.weight", _M + f"{n}_proj.kernel", "linear", None) for n in "qkvo")

MIXER_TABLES = {
    "softmax": LLAMA_ATTENTION,
    "deltanet": _FLA_QKVO + (
        (_A + "b_proj.weight", _M + "b_proj.kernel", "linear", None),
        (_A + "g_proj.weight", _M + "g_proj.kernel", "linear", "out_gate"),
    ),
    "gated_deltanet": _FLA_QKVO + (
        (_A + "a_proj.weight", _M + "a_proj.kernel", "linear", None),
        (_A + "b_proj.weight", _M + "b_proj.kernel", "linear", None),
        (_A + "A_log", _M + "A_log", "copy", None),
        (_A + "dt_bias", _M + "dt_bias", "copy", None),
        (_A + "g_proj.weight", _M + "g_proj.kernel", "linear", "out_gate"),
    ),
    "kda": _FLA_QKVO + _FLA_LOW_RANK + (
        (_A + "b_proj.weight", _M + "b_proj.kernel", "linear", None),
    ),
    "gdn2": _FLA_QKVO + _FLA_LOW_RANK + (
        (_A + "b_proj.weight", _M + "b_proj.kernel", "linear", None),
        (_A + "w_proj.weight", _M + "w_proj.kernel", "linear", None),
    ),
}


def rows(layer_mixers, flags: set[str]) -> list[tuple[str, str, str]]:
    """(target name, mixerlab path, layout) of a model with these per-layer mixers: the backbone (Llama for an
    all-softmax model, fla otherwise) and each layer's mixer table (softmax layers of an fla model: fla's
    ``Attention``); rows whose ``when`` is not in ``flags`` are left out."""
    llama = set(layer_mixers) == {"softmax"}
    backbone = LLAMA_BACKBONE if llama else FLA_BACKBONE
    out = _expand(backbone, range(len(layer_mixers)), flags)  # mixer tables hold per-layer rows only
    for i, mixer in enumerate(layer_mixers):
        table = FLA_ATTENTION if mixer == "softmax" and not llama else MIXER_TABLES[mixer]
        out += _expand(table, [i], flags)
    return out


def to_target(layout: str, x: np.ndarray) -> np.ndarray:
    if layout == "linear":
        return np.ascontiguousarray(x.T)
    if layout == "conv":
        return np.ascontiguousarray(x.T[:, None, :])
    return np.ascontiguousarray(x)


def from_target(layout: str, x: np.ndarray) -> np.ndarray:
    if layout == "linear":
        return np.ascontiguousarray(x.T)
    if layout == "conv":
        if x.ndim != 3 or x.shape[1] != 1:
            raise ValueError(f"a depthwise conv weight must be [C, 1, K], got {list(x.shape)}")
        return np.ascontiguousarray(x[:, 0, :].T)
    return np.ascontiguousarray(x)


def _expand(table, layers, flags: set[str]) -> list[tuple[str, str, str]]:
    """Rows with ``{i}`` once per layer in ``layers``; the others (embeddings, final norm, head) once."""
    out = []
    for name, path, layout, when in table:
        if when is not None and when not in flags:
            continue
        if "{i}" in name:
            out.extend((name.format(i=i), path.format(i=i), layout) for i in layers)
        else:
            out.append((name, path, layout))
    return out
