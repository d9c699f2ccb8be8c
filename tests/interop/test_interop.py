"""Checkpoint interop without torch: export -> import restores every parameter bit for bit (and the logits) for
every exportable mixer; the tensors carry the target's names and shapes (tables written here from the targets'
source: transformers' modeling_llama.py, fla 0.6.0's fla/layers/*.py and fla/models/*/modeling_*.py); every
refused setting is refused with one line naming its key; the run-directory path and the CLIs."""
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mixerlab.models.decoder import build_model
from mixerlab.interop import InteropRefused, export_model, export_run, import_model, import_run
from mixerlab.interop.hf_dir import flat_params
from mixerlab.training.config import from_dict

safetensors_numpy = pytest.importorskip("safetensors.numpy")

D, L, H, FFN, V = 64, 2, 2, 96, 300
EPS = 1e-6  # model.norm_eps; fla has one norm_eps for the block norms and the layer's output norm


def make_cfg(mixer, *, mixer_options=None, **model):
    m = {"mixer": mixer, "d_model": D, "num_layers": L, "num_heads": H, "ffn_dim": FFN, "vocab_size": V,
         "norm_eps": EPS} | model
    return from_dict({"model": m, "data": {"tokenizer": {"kind": "byte", "path": None}, "seq_len": 32},
                      "mixers": {mixer: mixer_options or {}} if mixer_options is not None else {}})


DV = D // H
LOW_RANK = {"norm_eps": EPS, "decay_rank": DV, "gate_rank": DV}
# every exportable mixer, with the option variants that change the tensor set or the mapping
EXPORTABLE = {
    "softmax": dict(mixer_options={"rope_theta": 5000.0}),
    "softmax_tied_hd24": dict(mixer="softmax", head_dim=24, tie_embeddings=True),
    "deltanet": dict(mixer_options={"norm_eps": EPS, "gate_act": "sigmoid"}),  # no output gate: act unused
    "deltanet_gate_noconv": dict(mixer="deltanet", mixer_options={"norm_eps": EPS, "use_output_gate": True,
                                                                  "use_short_conv": False}),
    "gated_deltanet": dict(mixer_options={"norm_eps": EPS, "allow_neg_eigval": True, "conv_size": 3}),
    "gated_deltanet_nogate_dv48": dict(mixer="gated_deltanet", value_head_dim=48,
                                       mixer_options={"norm_eps": EPS, "use_output_gate": False}),
    "gated_deltanet_sigmoid": dict(mixer="gated_deltanet", mixer_options={"norm_eps": EPS, "gate_act": "sigmoid"}),
    "kda": dict(mixer_options=LOW_RANK),
    "kda_safe_gate": dict(mixer="kda", mixer_options=LOW_RANK | {"safe_gate": True, "safe_gate_lower_bound": -3.0}),
    "gdn2": dict(mixer_options=LOW_RANK | {"gate_act": "sigmoid"}),
    "kda_softmax_hybrid": dict(mixer="kda", layer_pattern=["kda", "softmax"], mixer_options=LOW_RANK),
    "softmax_gated_deltanet_hybrid": dict(mixer="softmax", layer_pattern=["softmax", "gated_deltanet"],
                                          mixer_options={"rope_theta": 500.0}),
    # remat has no target field: it comes back from the stored mixerlab config
    "gdn2_tied": dict(mixer="gdn2", tie_embeddings=True, remat="block",
                      mixer_options=LOW_RANK | {"gate_act": "sigmoid"}),
}


def _cfg(case):
    spec = dict(EXPORTABLE[case])
    if case == "softmax_gated_deltanet_hybrid":  # options for two mixers
        cfg = make_cfg("softmax", layer_pattern=spec["layer_pattern"])
        raw = cfg.to_dict()
        raw["mixers"] = {"softmax": spec["mixer_options"], "gated_deltanet": {"norm_eps": EPS}}
        return from_dict(raw)
    return make_cfg(spec.pop("mixer", case), **spec)


def _randomize(model, seed=0):
    """Every parameter random (norm scales, biases and A_log too), so a swapped or transposed tensor shows."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    leaves = [0.5 + 0.3 * jax.random.normal(k, x.shape, x.dtype) if x.ndim == 1 else x for k, x in zip(keys, leaves)]
    return nnx.merge(graphdef, jax.tree.unflatten(tree, leaves), rest)


TOKENS = jnp.asarray(np.random.default_rng(0).integers(0, V, (2, 16)), jnp.int32)


@pytest.mark.parametrize("case", sorted(EXPORTABLE))
def test_round_trip_is_bit_exact(case, tmp_path):
    cfg = _cfg(case)
    model = _randomize(build_model(cfg, V, seed=1))
    model_type = export_model(model, cfg, str(tmp_path))
    cfg2, model2 = import_model(str(tmp_path))
    a, b = flat_params(model), flat_params(model2)
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype == np.float32 and np.array_equal(a[k], b[k]), k
    logits = nnx.jit(lambda m, tokens: m(tokens))  # one compile for both (same graph); eager is ~10x slower here
    np.testing.assert_array_equal(np.asarray(logits(model, TOKENS)), np.asarray(logits(model2, TOKENS)))
    assert cfg2.model == cfg.model
    assert all(cfg2.mixer_options(x) == cfg.mixer_options(x) for x in set(cfg.model.layer_mixers))
    hf = json.load(open(tmp_path / "config.json"))
    assert hf["model_type"] == model_type
    assert ("auto_map" in hf) == (model_type == "gdn2")  # gdn2: the import ignored its auto_map and model code


GDN2_AUTO_MAP = {"AutoConfig": "configuration_mixerlab_gdn2.GDN2Config",
                 "AutoModelForCausalLM": "modeling_mixerlab_gdn2.GDN2ForCausalLM"}
GDN2_CODE = ("configuration_mixerlab_gdn2.py", "modeling_mixerlab_gdn2.py")


def test_gdn2_export_carries_its_model_code(tmp_path):
    """No library defines a GDN-2 model: the directory holds the model code and the auto_map that points
    transformers' Auto classes at it; a target a library defines gets neither."""
    from mixerlab.interop import remote_code

    cfg = _cfg("gdn2")
    export_model(build_model(cfg, V), cfg, str(tmp_path / "g"))
    assert json.load(open(tmp_path / "g" / "config.json"))["auto_map"] == GDN2_AUTO_MAP
    for name in GDN2_CODE:
        with open(tmp_path / "g" / name, "rb") as a, open(remote_code.template_path(name), "rb") as b:
            assert a.read() == b.read(), name
    cfg = _cfg("kda")
    export_model(build_model(cfg, V), cfg, str(tmp_path / "k"))
    assert "auto_map" not in json.load(open(tmp_path / "k" / "config.json"))
    assert sorted(os.listdir(tmp_path / "k")) == ["config.json", "model.safetensors"]


def test_remote_code_imports_only_torch_transformers_and_fla():
    """The copied files run where mixerlab is not installed: their imports are torch, transformers, fla or each
    other (relative), and the auto_map names classes they define."""
    import ast

    from mixerlab.interop import remote_code

    defined = {}
    for name in GDN2_CODE:
        tree = ast.parse(open(remote_code.template_path(name)).read())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                roots = {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                roots = {"." + node.module} if node.level else {node.module.split(".")[0]}
            else:
                continue
            assert roots <= {"torch", "transformers", "fla", ".configuration_mixerlab_gdn2"}, (name, roots)
        defined[name[:-3]] = {n.name for n in tree.body if isinstance(n, ast.ClassDef)}
    for ref in GDN2_AUTO_MAP.values():
        module, cls = ref.split(".")
        assert cls in defined[module], ref


def test_vocab_size_left_to_the_tokenizer_stays_so(tmp_path):
    cfg = make_cfg("softmax", vocab_size=None)  # the byte tokenizer's 257 ids
    export_model(build_model(cfg, 257), cfg, str(tmp_path))
    assert json.load(open(tmp_path / "config.json"))["vocab_size"] == 257
    cfg2, model2 = import_model(str(tmp_path))
    assert cfg2.model.vocab_size is None and model2.embed.embedding.shape == (257, D)


# ---- the targets' names and shapes, from their source -----------------------------------------------------
def _backbone(prefix_embed, attn_norm, mlp_norm, tied, d=D, ffn=FFN, v=V, layers=L):
    names = {f"model.{prefix_embed}.weight": (v, d), "model.norm.weight": (d,)}
    if not tied:
        names["lm_head.weight"] = (v, d)
    for i in range(layers):
        p = f"model.layers.{i}."
        names |= {p + attn_norm + ".weight": (d,), p + mlp_norm + ".weight": (d,),
                  p + "mlp.gate_proj.weight": (ffn, d), p + "mlp.up_proj.weight": (ffn, d),
                  p + "mlp.down_proj.weight": (d, ffn)}
    return names


def _per_layer(attn):  # {suffix: shape} of layer i's token mixer, prefixed for every layer
    return {f"model.layers.{i}.{k}": s for i in range(L) for k, s in attn.items()}


def _fla_qkvo(hk, hv, conv=4, d=D):
    out = {"attn.q_proj.weight": (hk, d), "attn.k_proj.weight": (hk, d), "attn.v_proj.weight": (hv, d),
           "attn.o_proj.weight": (d, hv), "attn.o_norm.weight": (hv // H,)}
    if conv:
        out |= {"attn.q_conv1d.weight": (hk, 1, conv), "attn.k_conv1d.weight": (hk, 1, conv),
                "attn.v_conv1d.weight": (hv, 1, conv)}
    return out


def _fla_low_rank(hk, hv, r, d=D):
    return {"attn.f_proj.0.weight": (r, d), "attn.f_proj.1.weight": (hk, r), "attn.g_proj.0.weight": (r, d),
            "attn.g_proj.1.weight": (hv, r), "attn.g_proj.1.bias": (hv,), "attn.A_log": (H,), "attn.dt_bias": (hk,)}


EXPECTED = {
    "softmax": _backbone("embed_tokens", "input_layernorm", "post_attention_layernorm", False) | _per_layer(
        {f"self_attn.{n}_proj.weight": (D, D) for n in "qkvo"}),
    "softmax_tied_hd24": _backbone("embed_tokens", "input_layernorm", "post_attention_layernorm", True) | _per_layer(
        {"self_attn.q_proj.weight": (48, D), "self_attn.k_proj.weight": (48, D), "self_attn.v_proj.weight": (48, D),
         "self_attn.o_proj.weight": (D, 48)}),
    "deltanet": _backbone("embeddings", "attn_norm", "mlp_norm", False) | _per_layer(
        _fla_qkvo(D, D) | {"attn.b_proj.weight": (H, D)}),
    "deltanet_gate_noconv": _backbone("embeddings", "attn_norm", "mlp_norm", False) | _per_layer(
        _fla_qkvo(D, D, conv=0) | {"attn.b_proj.weight": (H, D), "attn.g_proj.weight": (D, D)}),
    "gated_deltanet": _backbone("embeddings", "attn_norm", "mlp_norm", False) | _per_layer(
        _fla_qkvo(D, D, conv=3) | {"attn.a_proj.weight": (H, D), "attn.b_proj.weight": (H, D), "attn.A_log": (H,),
                                   "attn.dt_bias": (H,), "attn.g_proj.weight": (D, D)}),
    "gated_deltanet_nogate_dv48": _backbone("embeddings", "attn_norm", "mlp_norm", False) | _per_layer(
        _fla_qkvo(D, 96) | {"attn.a_proj.weight": (H, D), "attn.b_proj.weight": (H, D), "attn.A_log": (H,),
                            "attn.dt_bias": (H,)}),
    "kda": _backbone("embeddings", "attn_norm", "mlp_norm", False) | _per_layer(
        _fla_qkvo(D, D) | _fla_low_rank(D, D, DV) | {"attn.b_proj.weight": (H, D)}),
    "gdn2": _backbone("embeddings", "attn_norm", "mlp_norm", False) | _per_layer(
        _fla_qkvo(D, D) | _fla_low_rank(D, D, DV) | {"attn.b_proj.weight": (D, D), "attn.w_proj.weight": (D, D)}),
}
_ATTN = {f"attn.{n}_proj.weight": (D, D) for n in "qkvo"}
EXPECTED["kda_softmax_hybrid"] = _backbone("embeddings", "attn_norm", "mlp_norm", False) | {
    f"model.layers.0.{k}": v for k, v in (_fla_qkvo(D, D) | _fla_low_rank(D, D, DV) | {"attn.b_proj.weight": (H, D)})
    .items()} | {f"model.layers.1.{k}": v for k, v in _ATTN.items()}
EXPECTED["softmax_gated_deltanet_hybrid"] = _backbone("embeddings", "attn_norm", "mlp_norm", False) | {
    f"model.layers.0.{k}": v for k, v in _ATTN.items()} | {f"model.layers.1.{k}": v for k, v in (
        _fla_qkvo(D, D) | {"attn.a_proj.weight": (H, D), "attn.b_proj.weight": (H, D), "attn.A_log": (H,),
                           "attn.dt_bias": (H,), "attn.g_proj.weight": (D, D)}).items()}
EXPECTED["gated_deltanet_sigmoid"] = EXPECTED["gated_deltanet"] | _per_layer(_fla_qkvo(D, D, conv=4))
EXPECTED["kda_safe_gate"] = EXPECTED["kda"]
EXPECTED["gdn2_tied"] = {k: v for k, v in EXPECTED["gdn2"].items() if k != "lm_head.weight"}
MODEL_TYPES = {"softmax_gated_deltanet_hybrid": "gated_deltanet",
               "softmax": "llama", "deltanet": "delta_net", "gated_deltanet": "gated_deltanet", "kda": "kda",
               "gdn2": "gdn2"}


@pytest.mark.parametrize("case", sorted(EXPECTED))
def test_tensor_names_and_shapes_are_the_targets(case, tmp_path):
    cfg = _cfg(case)
    assert export_model(build_model(cfg, V), cfg, str(tmp_path)) == MODEL_TYPES.get(case, MODEL_TYPES[
        cfg.model.mixer])
    tensors = safetensors_numpy.load_file(str(tmp_path / "model.safetensors"))
    assert {k: tuple(x.shape) for k, x in tensors.items()} == EXPECTED[case]
    assert all(x.dtype == np.float32 for x in tensors.values())


def test_layouts_transpose_linears_and_keep_the_conv_tap_order(tmp_path):
    cfg = _cfg("gdn2")
    model = build_model(cfg, V)
    export_model(model, cfg, str(tmp_path))
    t = safetensors_numpy.load_file(str(tmp_path / "model.safetensors"))
    mixer = model.blocks[1].mixer
    np.testing.assert_array_equal(t["model.layers.1.attn.q_proj.weight"], np.asarray(mixer.q_proj.kernel[...]).T)
    # torch's causal depthwise conv: y_t = sum_j weight[c, 0, j] x_{t-(K-1)+j}; mixerlab: sum_i W[K-1-i] x_{t-i}
    np.testing.assert_array_equal(t["model.layers.1.attn.k_conv1d.weight"][:, 0, :],
                                  np.asarray(mixer.k_conv.kernel[...]).T)


def test_config_json_fields(tmp_path):
    cfg = make_cfg("softmax", head_dim=24, mixer_options={"rope_theta": 5000.0})
    export_model(build_model(cfg, V), cfg, str(tmp_path))
    hf = json.load(open(tmp_path / "config.json"))
    assert (hf["num_attention_heads"], hf["num_key_value_heads"], hf["head_dim"], hf["rope_theta"],
            hf["rms_norm_eps"], hf["intermediate_size"], hf["tie_word_embeddings"], hf["hidden_act"]) == \
        (H, H, 24, 5000.0, EPS, FFN, False, "silu")
    cfg = _cfg("kda_safe_gate")
    export_model(build_model(cfg, V), cfg, str(tmp_path / "k"))
    hf = json.load(open(tmp_path / "k" / "config.json"))
    assert (hf["safe_gate"], hf["lower_bound"], hf["head_dim"], hf["expand_v"], hf["norm_eps"]) == \
        (True, -3.0, DV, 1.0, EPS)


# ---- refusals: one line naming the key ---------------------------------------------------------------------
REFUSED = {
    "model.layer_pattern": dict(mixer="gdn2", layer_pattern=["gdn2", "kda"]),
    "model.head_dim": dict(mixer="kda", layer_pattern=["kda", "softmax"], head_dim=24,
                           mixer_options=LOW_RANK | {"decay_rank": 24, "gate_rank": 24}),
    "model.mixer": dict(mixer="linear_attention"),
    "model.ffn_kind": dict(mixer="softmax", ffn_kind="mlp"),
    "model.vocab_size": dict(mixer="softmax", vocab_size=200),  # the byte tokenizer has 257 ids
    "mixers.softmax.use_short_conv": dict(mixer="softmax", mixer_options={"use_short_conv": True}),
    "mixers.gdn2.norm_eps": dict(mixer="gdn2", mixer_options={"decay_rank": DV, "gate_rank": DV,
                                                              "gate_act": "sigmoid"}),
    "mixers.gdn2.gate_act": dict(mixer="gdn2", mixer_options=LOW_RANK),
    "mixers.gdn2.decay_rank": dict(mixer="gdn2", mixer_options={"norm_eps": EPS, "gate_act": "sigmoid"}),
    "mixers.gdn2.gate_rank": dict(mixer="gdn2", mixer_options=LOW_RANK | {"gate_act": "sigmoid", "gate_rank": 16}),
    "mixers.kda.decay_rank": dict(mixer="kda", mixer_options={"norm_eps": EPS}),
    "mixers.kda.gate_act": dict(mixer="kda", mixer_options=LOW_RANK | {"gate_act": "silu"}),
    "mixers.gated_deltanet.norm_eps": dict(mixer="gated_deltanet", mixer_options={"norm_eps": 1e-5}),
    "mixers.deltanet.gate_act": dict(mixer="deltanet", mixer_options={"norm_eps": EPS, "use_output_gate": True,
                                                                      "gate_act": "sigmoid"}),
    "model.value_head_dim": dict(mixer="gated_deltanet", head_dim=7, value_head_dim=61,
                                 mixer_options={"norm_eps": EPS}),
}


@pytest.mark.parametrize("key", sorted(REFUSED))
def test_refused_setting_is_one_line_naming_the_key(key, tmp_path):
    spec = dict(REFUSED[key])
    cfg = make_cfg(spec.pop("mixer"), **spec)
    vocab = cfg.model.vocab_size
    with pytest.raises(InteropRefused) as e:
        export_model(build_model(cfg, vocab), cfg, str(tmp_path / "out"))
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(key + "=") and "nearest target" in msg
    assert not (tmp_path / "out").exists()  # refused before anything is written


def test_muir_is_refused():
    cfg = make_cfg("muir")
    with pytest.raises(InteropRefused, match=r"^model\.mixer='muir': "):
        export_model(build_model(cfg, V), cfg, "/nonexistent/never-written")


def _exported(tmp_path, case="softmax"):
    cfg = _cfg(case)
    out = tmp_path / "hf"
    export_model(build_model(cfg, V), cfg, str(out))
    return out


@pytest.mark.parametrize("case,field,value", [
    ("softmax", "num_key_value_heads", 1),
    ("softmax", "attention_bias", True),
    ("softmax", "mlp_bias", True),
    ("softmax", "model_type", "mistral"),
    ("softmax", "rope_scaling", {"rope_type": "linear", "factor": 2.0}),
    ("softmax", "hidden_act", "gelu"),
    ("kda_softmax_hybrid", "attn", [{"layers": [1], "num_heads": 2}, {"layers": [0], "num_heads": 2}]),
    ("kda_softmax_hybrid", "attn.window_size", 64),
    ("kda_softmax_hybrid", "attn.num_kv_heads", 1),
    ("kda_softmax_hybrid", "attn.qkv_bias", True),
    ("gdn2", "num_v_heads", 4),
    ("deltanet", "use_beta", False),
    ("deltanet", "qk_norm", "sum"),
    ("deltanet", "qk_activation", "relu"),
    ("deltanet", "use_output_norm", False),
    ("gated_deltanet", "output_gate_activation", "relu"),
    ("kda", "lower_bound", -5.0),
])
def test_import_refuses_what_mixerlab_cannot_hold(case, field, value, tmp_path):
    key = "config.json " + field
    out = _exported(tmp_path, case)
    hf = json.load(open(out / "config.json"))
    if field.startswith("attn."):
        hf["attn"][field[5:]] = value
    else:
        hf[field] = value
    json.dump(hf, open(out / "config.json", "w"))
    with pytest.raises(InteropRefused) as e:
        import_model(str(out))
    assert str(e.value).startswith(key + "=") and "\n" not in str(e.value)


def test_import_refuses_a_missing_or_extra_tensor(tmp_path):
    out = _exported(tmp_path, "gdn2")
    tensors = safetensors_numpy.load_file(str(out / "model.safetensors"))
    tensors["model.layers.0.attn.extra"] = np.zeros(3, np.float32)
    safetensors_numpy.save_file(tensors, str(out / "model.safetensors"))
    with pytest.raises(InteropRefused, match="model.layers.0.attn.extra"):
        import_model(str(out))
    del tensors["model.layers.0.attn.extra"], tensors["model.layers.1.attn.w_proj.weight"]
    safetensors_numpy.save_file(tensors, str(out / "model.safetensors"))
    with pytest.raises(InteropRefused, match="model.layers.1.attn.w_proj.weight"):
        import_model(str(out))


# ---- run directories and the console scripts ----------------------------------------------------------------
def test_run_directory_round_trip_and_clis(tmp_path, capsys):
    from mixerlab.eval.checkpoint import load_run
    from mixerlab.interop import export as export_cli
    from mixerlab.interop import import_ as import_cli

    cfg = _cfg("gdn2")
    model = _randomize(build_model(cfg, V), seed=4)
    export_model(model, cfg, str(tmp_path / "hf"))
    assert import_cli.main([str(tmp_path / "hf"), str(tmp_path / "run"), "--step", "7"]) == 0
    run = load_run(str(tmp_path / "run"))  # what eval and generate read
    assert run.step == 7
    a, b = flat_params(model), flat_params(run.model)
    assert all(np.array_equal(a[k], b[k]) for k in a) and sorted(a) == sorted(b)
    assert export_cli.main([str(tmp_path / "run"), str(tmp_path / "hf2")]) == 0
    assert "model_type gdn2, checkpoint step 7" in capsys.readouterr().out
    t1 = safetensors_numpy.load_file(str(tmp_path / "hf" / "model.safetensors"))
    t2 = safetensors_numpy.load_file(str(tmp_path / "hf2" / "model.safetensors"))
    assert sorted(t1) == sorted(t2) and all(np.array_equal(t1[k], t2[k]) for k in t1)
    assert export_run(str(tmp_path / "run"), str(tmp_path / "hf3"), 7)[1] == 7
    assert import_run  # the Python API the CLIs call


def test_cli_exit_codes(tmp_path, capsys):
    from mixerlab.interop import import_ as import_cli

    out = _exported(tmp_path)
    hf = json.load(open(out / "config.json"))
    hf["num_key_value_heads"] = 1
    json.dump(hf, open(out / "config.json", "w"))
    assert import_cli.main([str(out), str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "num_key_value_heads=1" in err
    assert import_cli.main([str(tmp_path / "missing"), str(tmp_path / "run2")]) == 2  # a missing input is the user's
    assert "config.json" in capsys.readouterr().err


def test_tokenizer_files_are_copied(tmp_path):
    tok = os.path.abspath("data/embedded/tokenizer.json")
    if not os.path.isfile(tok):
        pytest.skip(f"{tok} is not in this checkout")
    cfg = from_dict({"model": {"mixer": "softmax", "d_model": D, "num_layers": 1, "num_heads": H, "ffn_dim": FFN},
                     "data": {"tokenizer": {"kind": "hf", "path": tok}}})
    from mixerlab.training.tokenizer import load_tokenizer

    vocab = load_tokenizer("hf", tok).vocab_size
    notes = []
    export_model(build_model(cfg, vocab), cfg, str(tmp_path), notes=notes)
    assert open(tmp_path / "tokenizer.json", "rb").read() == open(tok, "rb").read()
    tok_cfg = json.load(open(tmp_path / "tokenizer_config.json"))
    assert tok_cfg["tokenizer_class"] == "PreTrainedTokenizerFast" and "eos_token" in tok_cfg
    cfg2, _ = import_model(str(tmp_path))
    assert cfg2.data.tokenizer.kind == "hf" and cfg2.data.tokenizer.path == str(tmp_path / "tokenizer.json")
    assert "tokenizer.json copied" in notes[0]
