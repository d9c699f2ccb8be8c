"""An in-memory mixerlab ``Decoder`` <-> an HF model directory (``config.json`` + ``model.safetensors`` + tokenizer
files; for a target no library defines, also its model code from ``remote_code/``). Tensors are written with
``safetensors.numpy`` (no torch needed), float32, in the target's names and layouts
(``interop/tables.py``). ``config.json`` also carries the whole mixerlab config under the key
``mixerlab``: import reads it back for the settings the target has no field for (data, optimizer, ...), while
the model's shape always comes from the target's own fields.
"""
from __future__ import annotations

import json
import os
import shutil

import jax
import numpy as np
from flax import nnx

from mixerlab.interop import remote_code, tables, targets
from mixerlab.interop.errors import InteropRefused

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
TOKENIZER_JSON = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
MIXERLAB_KEY = "mixerlab"


def _path_key(path) -> str:
    return ".".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


def flat_params(model) -> dict[str, np.ndarray]:
    """{dotted mixerlab path: float32 numpy array} of every ``nnx.Param`` of the model."""
    params = nnx.to_pure_dict(nnx.split(model, nnx.Param, ...)[1])
    return {_path_key(p): np.asarray(jax.device_get(x)) for p, x in jax.tree_util.tree_flatten_with_path(params)[0]}


def to_tensors(cfg, name: str, flat: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The target's tensors; every mixerlab parameter must be used by exactly one row."""
    rows = tables.rows(cfg.model.layer_mixers, targets.flags(cfg, name))
    used, out = set(), {}
    for target, path, layout in rows:
        if path not in flat:
            raise KeyError(f"mapping table of {name}: mixerlab parameter {path!r} does not exist in the model")
        out[target] = tables.to_target(layout, flat[path])
        used.add(path)
    left = sorted(set(flat) - used)
    if left:
        raise InteropRefused(f"{left[0]}: a parameter of this {name} model that the target has no tensor for "
                             f"({len(left)} in all); nearest target that holds it: none")
    return out


def _tokenizer_files(cfg, tokenizer_path: str | None, out_dir: str, eos_id: int | None) -> str:
    """Copies the tokenizer next to the weights; returns a one-line note of what was written."""
    kind = cfg.data.tokenizer.kind
    path = tokenizer_path or cfg.data.tokenizer.path
    if kind == "byte":
        return "tokenizer: byte (ids 0..255 are the bytes, 256 is EOS); no HF tokenizer file written"
    if not path or not os.path.isfile(path):
        return f"tokenizer: {kind} file {path!r} not found; no tokenizer files written"
    if kind == "sentencepiece":
        shutil.copyfile(path, os.path.join(out_dir, "tokenizer.model"))
        note = "tokenizer: sentencepiece model copied as tokenizer.model (tokenizer_class LlamaTokenizer)"
        tok_cfg = {"tokenizer_class": "LlamaTokenizer"}
    else:
        shutil.copyfile(path, os.path.join(out_dir, TOKENIZER_JSON))
        note = "tokenizer: tokenizer.json copied, tokenizer_config.json written (PreTrainedTokenizerFast)"
        tok_cfg = {"tokenizer_class": "PreTrainedTokenizerFast"}
    eos = _token_string(kind, path, eos_id)
    if eos is not None:
        tok_cfg["eos_token"] = eos
    tok_cfg["model_max_length"] = cfg.data.seq_len
    with open(os.path.join(out_dir, TOKENIZER_CONFIG), "w") as f:
        json.dump(tok_cfg, f, indent=2)
    return note


def _token_string(kind: str, path: str, token_id: int | None) -> str | None:
    if token_id is None:
        return None
    try:
        from mixerlab.training.tokenizer import load_tokenizer

        tok = load_tokenizer(kind, path)
        inner = getattr(tok, "_tok", None) or getattr(tok, "_sp", None)
        return inner.id_to_token(token_id) if hasattr(inner, "id_to_token") else inner.id_to_piece(token_id)
    except Exception:  # a tokenizer without a string for its EOS id: leave eos_token out
        return None


def _tokenizer_facts(cfg, tokenizer_path: str | None) -> tuple[int | None, int | None]:
    """(vocabulary size, EOS id) of the run's tokenizer, or (None, None) when its file is not at hand."""
    from mixerlab.training.tokenizer import load_tokenizer

    kind, path = cfg.data.tokenizer.kind, tokenizer_path or cfg.data.tokenizer.path
    if kind != "byte" and (not path or not os.path.isfile(path)):
        return None, None
    tok = load_tokenizer(kind, None if kind == "byte" else path)
    return tok.vocab_size, tok.eos_id


def export_model(model, cfg, out_dir: str, tokenizer_path: str | None = None, *, notes: list | None = None) -> str:
    """Writes ``out_dir`` (config.json, model.safetensors, tokenizer files) for an in-memory ``Decoder`` and its
    config (``training.config.Config``); returns the HF ``model_type`` written. Refuses (``InteropRefused``, one
    line) every setting the target cannot hold, before anything is written."""
    from safetensors.numpy import save_file

    vocab_size = int(model.embed.embedding.shape[0])
    tok_vocab, eos_id = _tokenizer_facts(cfg, tokenizer_path)
    name = targets.check(cfg, vocab_size, tok_vocab)
    tensors = to_tensors(cfg, name, flat_params(model))
    hf = targets.hf_config(cfg, name, vocab_size, eos_id)
    auto_map = remote_code.auto_map(hf["model_type"])
    if auto_map:  # a model no library defines: transformers runs the copied model code (trust_remote_code)
        hf["auto_map"] = auto_map
    hf[MIXERLAB_KEY] = cfg.to_dict()
    os.makedirs(out_dir, exist_ok=True)
    save_file(tensors, os.path.join(out_dir, WEIGHTS), metadata={"format": "pt"})
    with open(os.path.join(out_dir, CONFIG), "w") as f:
        json.dump(hf, f, indent=2)
    remote_code.write(hf["model_type"], out_dir)
    note = _tokenizer_files(cfg, tokenizer_path, out_dir, eos_id)
    if notes is not None:
        notes.append(note)
    return hf["model_type"]


# --------------------------------------------------------------------------------------------- import
def read_config(hf_dir: str) -> dict:
    path = os.path.join(hf_dir, CONFIG)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{hf_dir!r}: no {CONFIG} (expected an HF model directory)")
    with open(path) as f:
        return json.load(f)


def config_from_hf(hf: dict, hf_dir: str):
    """The mixerlab ``Config`` of an HF directory: its stored mixerlab config (if any) with the model shape and
    mixer options taken from the target's own fields."""
    from mixerlab.training.config import from_dict

    name, model, mixers = targets.from_hf(hf)
    raw = json.loads(json.dumps(hf.get(MIXERLAB_KEY) or {}))
    stored = raw.get("model") or {}
    raw_model = {k: v for k, v in stored.items() if k not in model}  # dtype, remat, ...: no target field
    # widths the stored config left unset (derived) stay unset when the target's values equal the derived ones
    if stored.get("head_dim") is None and model["head_dim"] == model["d_model"] // model["num_heads"]:
        model["head_dim"] = None
    if stored.get("value_head_dim") is None and model["value_head_dim"] in (None, model["head_dim"]
                                                                           or model["d_model"] // model["num_heads"]):
        model["value_head_dim"] = None
    if stored.get("layer_pattern") and model.get("layer_pattern"):  # the stored period if it tiles the same way
        n, period = model["num_layers"], list(stored["layer_pattern"])
        if [period[i % len(period)] for i in range(n)] == model["layer_pattern"]:
            model["layer_pattern"] = period
        model["mixer"] = stored.get("mixer", model["mixer"])  # unused beside a layer_pattern: keep it as stored
    raw["model"] = raw_model | model
    old = raw.get("mixers") or {}
    raw["mixers"] = {k: (old.get(k) or {}) | v for k, v in mixers.items()}
    data = raw.setdefault("data", {})
    tok = os.path.join(hf_dir, TOKENIZER_JSON)
    if os.path.isfile(tok):
        data["tokenizer"] = {"kind": "hf", "path": os.path.abspath(tok)}
    elif os.path.isfile(os.path.join(hf_dir, "tokenizer.model")):
        data["tokenizer"] = {"kind": "sentencepiece", "path": os.path.abspath(os.path.join(hf_dir, "tokenizer.model"))}
    elif (data.get("tokenizer") or {}).get("kind") != "byte":
        data["tokenizer"] = {"kind": "byte", "path": None}
    if "vocab_size" in stored and stored["vocab_size"] is None and _tokenizer_vocab(data) == model["vocab_size"]:
        raw["model"]["vocab_size"] = None  # the stored config took the tokenizer's size, and it still fits
    return from_dict(raw)


def _tokenizer_vocab(data: dict) -> int | None:
    from mixerlab.training.tokenizer import load_tokenizer

    tok = data.get("tokenizer") or {}
    try:
        return load_tokenizer(tok.get("kind", "hf"), tok.get("path")).vocab_size
    except (OSError, ValueError):
        return None


def import_model(hf_dir: str):
    """(cfg, model) of an HF directory written by ``export_model`` (or any checkpoint of the same target whose
    settings mixerlab can hold); parameters float32, bit for bit the stored tensors. Reads config.json and
    model.safetensors only: an ``auto_map`` and copied model code are ignored."""
    from safetensors.numpy import load_file

    from mixerlab.models.decoder import abstract_model, build_model

    hf = read_config(hf_dir)
    cfg = config_from_hf(hf, hf_dir)
    name = targets.target_mixer(cfg)
    weights = os.path.join(hf_dir, WEIGHTS)
    if not os.path.isfile(weights):
        raise FileNotFoundError(f"{hf_dir!r}: no {WEIGHTS} (sharded or .bin checkpoints are not read)")
    tensors = load_file(weights)
    if cfg.model.tie_embeddings:
        tensors.pop("lm_head.weight", None)  # some writers store the tied head too
    vocab = int(hf["vocab_size"])
    rows = tables.rows(cfg.model.layer_mixers, targets.flags(cfg, name))
    graphdef, abstract, _ = nnx.split(abstract_model(cfg, vocab), nnx.Param, ...)
    shapes = {_path_key(p): x for p, x in jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(abstract))[0]}
    flat = {}
    for target, path, layout in rows:
        if target not in tensors:
            raise InteropRefused(f"{WEIGHTS}: tensor {target!r} is missing for a {hf['model_type']} model of this "
                                 f"config; nearest target that holds it: none")
        x = tables.from_target(layout, np.asarray(tensors.pop(target)))
        want = shapes[path]
        if tuple(x.shape) != tuple(want.shape):
            raise InteropRefused(f"{WEIGHTS}: tensor {target!r} has shape {list(tensors.get(target, x).shape)} "
                                 f"-> {list(x.shape)}, the model needs {list(want.shape)} at {path}; nearest "
                                 f"target that holds it: none")
        flat[path] = x.astype(np.float32) if x.dtype != np.float32 else x
    if tensors:
        extra = sorted(tensors)
        raise InteropRefused(f"{WEIGHTS}: tensor {extra[0]!r} has no place in mixerlab's {name} model ({len(extra)} "
                             f"such tensors); nearest target that holds it: none")
    pure = nnx.to_pure_dict(abstract)
    leaves_with_path = jax.tree_util.tree_flatten_with_path(pure)
    restored = jax.tree_util.tree_unflatten(leaves_with_path[1],
                                            [jax.numpy.asarray(flat[_path_key(p)]) for p, _ in leaves_with_path[0]])
    rest = jax.jit(lambda: nnx.split(build_model(cfg, vocab), nnx.Param, ...)[2])()
    nnx.replace_by_pure_dict(abstract, restored)
    return cfg, nnx.merge(graphdef, abstract, rest)
