"""Per target: which mixerlab settings it can hold (the rest are refused), its HF ``config.json``, and the way
back from that config to mixerlab's ``model`` / ``mixers`` sections.

Targets: ``softmax`` -> HF transformers ``LlamaForCausalLM`` (model_type ``llama``); ``deltanet``,
``gated_deltanet``, ``kda``, ``gdn2`` -> the flash-linear-attention (fla) models ``delta_net``, ``gated_deltanet``,
``kda`` (``fla.models``, flash-linear-attention 0.6.0) and ``gdn2`` (fla 0.6.0 ships the layer
``fla.layers.GatedDeltaNet2`` but no model class: the directory uses the KDA model's layout and carries its own
model code, ``remote_code/``, see docs/interop.md).

Settings that only choose an implementation or an initialisation (``implementation``, ``chunk_size``,
``leaf_size``, ``init_scheme``, ``model.remat``, ``model.dtype``) change no weight and no output of the exported
model: they are not refused, and come back from the stored mixerlab config on import.
"""
from __future__ import annotations

import dataclasses

from mixerlab.interop.errors import refuse

LLAMA = "llama"
FLA_MODEL_TYPES = {"deltanet": "delta_net", "gated_deltanet": "gated_deltanet", "kda": "kda", "gdn2": "gdn2"}
MODEL_TYPES = {"softmax": LLAMA, **FLA_MODEL_TYPES}
MIXER_OF = {v: k for k, v in MODEL_TYPES.items()}
ARCHITECTURES = {"llama": "LlamaForCausalLM", "delta_net": "DeltaNetForCausalLM",
                 "gated_deltanet": "GatedDeltaNetForCausalLM", "kda": "KDAForCausalLM", "gdn2": "GDN2ForCausalLM"}
_TARGETS = "softmax -> llama; deltanet, gated_deltanet, kda, gdn2 -> fla"


def target_mixer(cfg) -> str:
    """The model's mixer (a hybrid's recurrent one); refused: hybrids a target cannot hold, mixers without one."""
    m = cfg.model
    mixers = sorted(set(m.layer_mixers))
    recurrent = [x for x in mixers if x != "softmax"]
    if len(recurrent) > 1 or (len(mixers) > 1 and recurrent[0] not in FLA_MODEL_TYPES):
        raise refuse("model.layer_pattern", list(m.layer_pattern),
                     "a hybrid of these mixers; fla's models hold one recurrent mixer plus softmax layers (attn), "
                     "Llama holds softmax only", "fla with one of " + ", ".join(FLA_MODEL_TYPES) + " + softmax")
    name = recurrent[0] if recurrent else "softmax"
    if name not in MODEL_TYPES:
        raise refuse("model.mixer", name, f"no HF transformers or fla model holds this mixer (targets: {_TARGETS})")
    return name


def hybrid(cfg) -> bool:
    return len(set(cfg.model.layer_mixers)) > 1


def check(cfg, vocab_size: int, tokenizer_vocab: int | None) -> str:
    """Refuses every setting the target cannot hold; returns the mixer name."""
    name = target_mixer(cfg)
    m = cfg.model
    if m.ffn_kind != "swiglu":
        raise refuse("model.ffn_kind", m.ffn_kind, f"a 2-matrix {m.ffn_activation} FFN; Llama and fla models have "
                     "a SwiGLU FFN (gate, up, down) only")
    if tokenizer_vocab is not None and tokenizer_vocab > vocab_size:
        raise refuse("model.vocab_size", vocab_size, f"smaller than the tokenizer's vocabulary ({tokenizer_vocab}); "
                     "token ids past the embedding cannot be represented")
    _CHECKS[name](cfg, cfg.mixer_options(name))
    if hybrid(cfg) and m.key_head_dim != m.d_model // m.num_heads:
        raise refuse("model.head_dim", m.key_head_dim, f"fla's attention layers (attn) have head_dim = hidden_size / "
                     f"num_heads ({m.d_model // m.num_heads})", "Llama (softmax layers only)")
    return name


def _check_softmax(cfg, o) -> None:
    # rope_theta -> rope_theta; implementation is not a weight
    if o.use_short_conv:
        raise refuse("mixers.softmax.use_short_conv", True, "Llama's and fla's attention layers have no short "
                     "convolution on q, k, v")


def _check_delta(cfg, o, name: str, *, expand_v: bool = True) -> None:
    """``expand_v``: the target derives the value head width as int(head_dim * expand_v) (all but DeltaNet)."""
    m = cfg.model
    if o.norm_eps != m.norm_eps:
        raise refuse(f"mixers.{name}.norm_eps", o.norm_eps,
                     f"differs from model.norm_eps={m.norm_eps}; fla's config has one norm_eps for the block norms "
                     "and the layer's output norm (train with equal values)")
    dk, dv = m.key_head_dim, m.value_width
    if expand_v and int(dk * (dv / dk)) != dv:
        raise refuse("model.value_head_dim", dv, f"fla's expand_v = value_head_dim / head_dim ({dv}/{dk}) does not "
                     "give it back exactly")


def _check_gated_deltanet(cfg, o) -> None:
    _check_delta(cfg, o, "gated_deltanet")


def _check_deltanet(cfg, o) -> None:
    _check_delta(cfg, o, "deltanet", expand_v=False)  # its widths come from expand_k/expand_v * d_model
    if o.use_output_gate and o.gate_act != "silu":
        raise refuse("mixers.deltanet.gate_act", o.gate_act, "fla's DeltaNet output gate is swish (silu) only",
                     "fla gated_deltanet (output_gate_activation)")


def _check_low_rank(cfg, o, name: str) -> None:
    _check_delta(cfg, o, name)
    dv = cfg.model.value_width
    for key in ("decay_rank", "gate_rank"):
        if getattr(o, key) != dv:
            raise refuse(f"mixers.{name}.{key}", getattr(o, key), f"fla's layer fixes the rank of f_proj and g_proj "
                         f"to the value head width ({dv})")
    if o.gate_act != "sigmoid":
        raise refuse(f"mixers.{name}.gate_act", o.gate_act, "fla's layer gates its output norm with a sigmoid only",
                     "fla gated_deltanet for a silu gate (other gates)" if name == "gdn2" else "none")


def _check_kda(cfg, o) -> None:
    _check_low_rank(cfg, o, "kda")


def _check_gdn2(cfg, o) -> None:
    _check_low_rank(cfg, o, "gdn2")


_CHECKS = {"softmax": _check_softmax, "deltanet": _check_deltanet, "gated_deltanet": _check_gated_deltanet,
           "kda": _check_kda, "gdn2": _check_gdn2}


def _expand(m, width: int) -> float:
    return m.num_heads * width / m.d_model


def flags(cfg, name: str) -> set[str]:
    """The ``when`` conditions of the mapping table that hold for this config."""
    o = cfg.mixer_options(name)
    out = set() if cfg.model.tie_embeddings else {"untied"}
    if getattr(o, "use_short_conv", False):
        out.add("short_conv")
    if getattr(o, "use_output_gate", False):
        out.add("out_gate")
    return out


# --------------------------------------------------------------------------------------------- config.json
def hf_config(cfg, name: str, vocab_size: int, eos_id: int | None) -> dict:
    m = cfg.model
    model_type = MODEL_TYPES[name]
    common = {"architectures": [ARCHITECTURES[model_type]], "model_type": model_type, "vocab_size": vocab_size,
              "hidden_size": m.d_model, "intermediate_size": m.ffn_dim, "num_hidden_layers": m.num_layers,
              "tie_word_embeddings": m.tie_embeddings, "initializer_range": m.init_std,
              "max_position_embeddings": cfg.data.seq_len, "bos_token_id": None, "eos_token_id": eos_id,
              "pad_token_id": None, "torch_dtype": "float32", "use_cache": True}
    if name == "softmax":
        theta = cfg.mixer_options(name).rope_theta
        return common | {"num_attention_heads": m.num_heads, "num_key_value_heads": m.num_heads,
                         "head_dim": m.key_head_dim, "hidden_act": "silu", "rms_norm_eps": m.norm_eps,
                         "rope_theta": theta, "rope_parameters": {"rope_type": "default", "rope_theta": theta},
                         "attention_bias": False, "attention_dropout": 0.0, "mlp_bias": False,
                         "pretraining_tp": 1}
    o = cfg.mixer_options(name)
    fla = common | {"attn_mode": "chunk", "num_heads": m.num_heads, "hidden_act": "swish", "hidden_ratio": 4,
                    "norm_eps": m.norm_eps, "use_short_conv": o.use_short_conv, "conv_size": o.conv_size,
                    "allow_neg_eigval": o.allow_neg_eigval, "attn": None, "fuse_norm": True, "fuse_swiglu": True,
                    "fuse_cross_entropy": True, "use_l2warp": False}
    if hybrid(cfg):
        fla["attn"] = {"layers": [i for i, x in enumerate(m.layer_mixers) if x == "softmax"],
                       "num_heads": m.num_heads, "num_kv_heads": m.num_heads, "qkv_bias": False, "window_size": None,
                       "rope_theta": cfg.mixer_options("softmax").rope_theta}
    if name == "deltanet":
        return fla | {"expand_k": _expand(m, m.key_head_dim), "expand_v": _expand(m, m.value_width),
                      "use_gate": o.use_output_gate, "use_beta": True, "use_output_norm": True, "qk_norm": "l2",
                      "qk_activation": "silu"}
    fla |= {"head_dim": m.key_head_dim, "expand_v": m.value_width / m.key_head_dim, "num_v_heads": None}
    if name == "gated_deltanet":
        return fla | {"use_gate": o.use_output_gate,
                      "output_gate_activation": "swish" if o.gate_act == "silu" else o.gate_act}
    if name == "kda":
        return fla | {"safe_gate": o.safe_gate, "lower_bound": o.safe_gate_lower_bound if o.safe_gate else None}
    return fla  # gdn2


# --------------------------------------------------------------------------------------------- the way back
_SUPPORTED_IMPORT = ", ".join(sorted(MIXER_OF))


def _need(hf: dict, key: str, ok, why: str):
    value = hf.get(key)
    if not ok(value):
        raise refuse(f"config.json {key}", value, why)
    return value


def from_hf(hf: dict) -> tuple[str, dict, dict]:
    """(mixer name, mixerlab ``model`` fields, {mixer: ``mixers.<mixer>`` fields}) of an HF config; refuses what
    mixerlab's Decoder cannot hold."""
    model_type = hf.get("model_type")
    if model_type not in MIXER_OF:
        raise refuse("config.json model_type", model_type, f"mixerlab imports {_SUPPORTED_IMPORT}")
    name = MIXER_OF[model_type]
    d, heads = hf["hidden_size"], hf.get("num_attention_heads" if name == "softmax" else "num_heads")
    model = {"mixer": name, "layer_pattern": None, "vocab_size": hf["vocab_size"], "d_model": d,
             "num_layers": hf["num_hidden_layers"], "num_heads": heads, "ffn_kind": "swiglu",
             "ffn_dim": hf["intermediate_size"], "tie_embeddings": bool(hf.get("tie_word_embeddings", False))}
    if hf.get("initializer_range") is not None:
        model["init_std"] = hf["initializer_range"]
    _need(hf, "hidden_act", lambda v: v in ("silu", "swish"), "mixerlab's SwiGLU FFN uses silu")
    if name == "softmax":
        _need(hf, "num_key_value_heads", lambda v: v in (None, heads),
              f"grouped-query attention; mixerlab's softmax mixer has num_key_value_heads == num_attention_heads "
              f"({heads})")
        _need(hf, "attention_bias", lambda v: not v, "mixerlab's attention projections have no bias")
        _need(hf, "mlp_bias", lambda v: not v, "mixerlab's SwiGLU has no bias")
        rope = hf.get("rope_parameters") or {}
        _need({"rope_scaling": hf.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default"
                                                            else None)}, "rope_scaling", lambda v: not v,
              "mixerlab's RoPE has no scaling")
        theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
        model |= {"head_dim": hf.get("head_dim") or d // heads, "value_head_dim": None, "norm_eps": hf["rms_norm_eps"]}
        return name, model, {name: {"rope_theta": float(theta)}}
    mixers = {}
    if hf.get("attn"):
        model["layer_pattern"], mixers["softmax"] = _attn_layers(hf, name, heads)
    _need(hf, "num_v_heads", lambda v: v in (None, heads), "grouped value heads; mixerlab has one value head per "
          "query head")
    eps = hf["norm_eps"]
    model["norm_eps"] = eps
    mixer = {"norm_eps": eps, "use_short_conv": bool(hf.get("use_short_conv", True)),
             "conv_size": hf.get("conv_size", 4), "allow_neg_eigval": bool(hf.get("allow_neg_eigval", False))}
    if name == "deltanet":
        dk = round(d * hf.get("expand_k", 1.0)) // heads
        dv = round(d * hf.get("expand_v", 1.0)) // heads
        _need(hf, "use_beta", lambda v: v in (None, True), "mixerlab's DeltaNet always has beta")
        _need(hf, "qk_norm", lambda v: v in (None, "l2"), "mixerlab L2-normalises q and k")
        _need(hf, "qk_activation", lambda v: v in (None, "silu"), "mixerlab's q/k activation is silu")
        _need(hf, "use_output_norm", lambda v: v in (None, True), "mixerlab always normalises the output")
        mixer["use_output_gate"] = bool(hf.get("use_gate", False))
        if mixer["use_output_gate"]:  # fla's gate is swish; without a gate, gate_act stays as stored
            mixer["gate_act"] = "silu"
    else:
        dk = hf["head_dim"]
        dv = int(dk * hf.get("expand_v", 1.0))
        if name == "gated_deltanet":
            act = _need(hf, "output_gate_activation", lambda v: v in (None, "swish", "silu", "sigmoid"),
                        "mixerlab's output gates are silu or sigmoid")
            mixer |= {"use_output_gate": bool(hf.get("use_gate", True)),
                      "gate_act": "sigmoid" if act == "sigmoid" else "silu"}
        else:
            mixer |= {"decay_rank": dv, "gate_rank": dv, "gate_act": "sigmoid"}
        if name == "kda" and hf.get("safe_gate"):
            mixer |= {"safe_gate": True, "safe_gate_lower_bound": float(hf["lower_bound"])}
        elif name == "kda":
            _need(hf, "lower_bound", lambda v: v is None, "a clamp without safe_gate; mixerlab's KDA bounds the "
                  "decay only with safe_gate")
    model |= {"head_dim": dk, "value_head_dim": dv}
    return name, model, {name: mixer} | mixers


def _attn_layers(hf: dict, name: str, heads: int) -> tuple[list, dict]:
    """fla's ``attn`` hybrid setting -> (mixerlab layer_pattern, mixers.softmax fields)."""
    specs = hf["attn"] if isinstance(hf["attn"], list) else [hf["attn"]]
    if len(specs) != 1:
        raise refuse("config.json attn", specs, "several attention specs; mixerlab has one softmax mixer setting")
    spec = specs[0]
    for key, ok, why in (("num_kv_heads", lambda v: v in (None, heads), "grouped-query attention"),
                         ("num_heads", lambda v: v == heads, "attention heads other than the model's num_heads"),
                         ("qkv_bias", lambda v: not v, "q/k/v biases"), ("qk_norm", lambda v: not v, "q/k norms"),
                         ("window_size", lambda v: v is None, "sliding-window attention")):
        if not ok(spec.get(key)):
            raise refuse(f"config.json attn.{key}", spec.get(key), f"{why}; mixerlab's softmax mixer has none")
    layers = set(spec["layers"])
    pattern = ["softmax" if i in layers else name for i in range(hf["num_hidden_layers"])]
    return pattern, {"rope_theta": float(spec.get("rope_theta") or 10000.0)}


def options_dict(options) -> dict:
    return dataclasses.asdict(options)
