"""Config loading: inheritance, dotted overrides, and one clear error per bad key/type/combination."""
import os
import pytest

from mixerlab.training.config import Config, ConfigError, load_config


def test_base_config_loads_with_defaults():
    cfg = load_config("configs/base.yaml")
    assert isinstance(cfg, Config)
    assert cfg.model.mixer == "softmax"
    assert cfg.head_dim == cfg.model.d_model // cfg.model.num_heads


def test_inherit_and_overrides_apply_in_order():
    cfg = load_config("configs/tiny.yaml", ["model.mixer=linear_attention", "train.steps=7", "optim.lr=1e-4"])
    assert cfg.model.d_model == 64  # from tiny.yaml
    assert cfg.data.tokenizer.kind == "hf"  # from base.yaml through inherit
    assert cfg.model.mixer == "linear_attention"
    assert cfg.train.steps == 7
    assert cfg.optim.lr == pytest.approx(1e-4)


def test_layer_pattern_tiles_layers():
    cfg = load_config("configs/tiny.yaml", ["model.num_layers=4", "model.layer_pattern=[linear_attention,softmax]"])
    assert cfg.layer_mixers == ("linear_attention", "softmax", "linear_attention", "softmax")


@pytest.mark.parametrize("override, fragments", [
    (["model.mixr=gdn2"], ["model.mixr", "unknown key", "mixer"]),
    (["train.steps=abc"], ["train.steps", "'abc'", "int"]),
    (["train.steps=1.5"], ["train.steps", "1.5", "int"]),
    (["model.dtype=float16"], ["model.dtype", "float16", "'bfloat16'"]),
    (["model.mixer=nope"], ["model.mixer", "nope", "softmax"]),
    (["model.num_heads=3"], ["model.num_heads", "3", "model.d_model"]),
    (["model.layer_pattern=[softmax,softmax,softmax]", "model.num_layers=4"], ["model.layer_pattern", "num_layers"]),
    (["optim.warmup_steps=1000", "train.steps=10"], ["optim.warmup_steps", "1000", "train.steps"]),
    (["mixers.nope.x=1"], ["mixers.nope", "registered mixers"]),
    (["mixers.softmax.rope_thetaa=1"], ["mixers.softmax.rope_thetaa", "rope_theta"]),
    (["mixers.softmax.implementation=triton"], ["mixers.softmax.implementation", "'cudnn'"]),
    (["data.tokenizer.kind=bpe"], ["data.tokenizer.kind", "bpe", "'sentencepiece'"]),
    (["train=5"], ["train", "mapping"]),
    (["notakey"], ["notakey", "section.key=value"]),
    (["optim.b1=1.5"], ["optim.b1", "1.5", "[0, 1)"]),
    (["optim.b2=-1"], ["optim.b2", "-1", "[0, 1)"]),
    (["optim.eps=-1"], ["optim.eps", "-1", "> 0"]),
    (["optim.eps=0"], ["optim.eps", "0", "> 0"]),
    (["optim.weight_decay=-5"], ["optim.weight_decay", "-5", ">= 0"]),
    (["optim.grad_clip=-1"], ["optim.grad_clip", "-1", "> 0", "null"]),
    (["optim.lr=.nan"], ["optim.lr", "nan", "finite"]),
    (["model.init_std=-1"], ["model.init_std", "-1", "> 0"]),
    (["model.norm_eps=-1"], ["model.norm_eps", "-1", "> 0"]),
    (["train.seed=-1"], ["train.seed", "-1", "[0, 2**32)"]),
    (["train.gpu_memory_fraction=1.5"], ["train.gpu_memory_fraction", "1.5", "(0, 1]", "null"]),
    (["train.gpu_memory_fraction=0"], ["train.gpu_memory_fraction", "0", "(0, 1]"]),
])
def test_bad_config_is_one_clear_error(override, fragments):
    with pytest.raises(ConfigError) as err:
        load_config("configs/tiny.yaml", override)
    msg = str(err.value)
    for fragment in fragments:
        assert fragment in msg, f"{fragment!r} missing from: {msg}"


def test_grad_clip_null_turns_clipping_off():
    from mixerlab.training.optim import make_optimizer

    assert load_config("configs/tiny.yaml", ["optim.grad_clip=null"]).optim.grad_clip is None
    cfg = load_config("configs/tiny.yaml", ["optim.grad_clip=null"])
    assert len(make_optimizer(cfg, {}).init({})) == 1  # no clip_by_global_norm in the chain


def test_missing_file_and_bad_yaml(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(str(tmp_path / "nope.yaml"))
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(str(bad))
    cyc = tmp_path / "cyc.yaml"
    cyc.write_text("inherit: cyc.yaml\n")
    with pytest.raises(ConfigError, match="cycle"):
        load_config(str(cyc))


def test_mixer_options_are_typed():
    cfg = load_config("configs/tiny.yaml", ["mixers.softmax.rope_theta=500000"])
    assert cfg.mixer_options("softmax").rope_theta == 500000.0
    assert isinstance(cfg.mixer_options("softmax").rope_theta, float)
    assert cfg.to_dict()["mixers"]["softmax"]["rope_theta"] == 500000.0


def test_base_yaml_spells_out_every_default():
    """configs/base.yaml is the documented list of keys: it must name every key with the code's default."""
    import yaml

    from mixerlab.training.config import from_dict

    raw = yaml.safe_load(open("configs/base.yaml"))
    assert from_dict(raw).to_dict() == Config().to_dict()

    def keys(d, prefix=""):
        for k, v in d.items():
            if isinstance(v, dict) and v:
                yield from keys(v, f"{prefix}{k}.")
            else:
                yield f"{prefix}{k}"

    assert set(keys(raw)) == set(keys(Config().to_dict()))


def test_mixer_options_reject_impossible_combinations_as_config_errors():
    with pytest.raises(ConfigError, match="mixers.muir.ranks"):
        load_config("configs/tiny.yaml", ["model.mixer=muir", "mixers.muir.gamma=static",
                                          "mixers.muir.ranks=[64,64,128,128,128]"])


@pytest.mark.parametrize("text, key, line, first", [
    ("train:\n  steps: 5\nmodel:\n  d_model: 64\ntrain:\n  batch_size: 2\n", "train", 5, 1),  # a section twice
    ("inherit: tiny.yaml\nmodel:\n  d_model: 64\n  num_layers: 1\n  d_model: 32\n", "d_model", 5, 3),  # nested
    ("mixers:\n  muir:\n    gamma: static\n    gamma: learned\n", "gamma", 4, 3),  # three levels down
])
def test_duplicate_yaml_keys_are_refused_with_file_line_and_key(tmp_path, text, key, line, first):
    path = tmp_path / "dup.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_config(str(path))
    msg = str(err.value)
    for fragment in (str(path), f"line {line}", repr(key), "appears twice", f"first on line {first}"):
        assert fragment in msg, f"{fragment!r} missing from: {msg}"


def test_yaml_merge_keys_are_not_duplicates(tmp_path):
    path = tmp_path / "merge.yaml"
    path.write_text("inherit: " + os.path.abspath("configs/tiny.yaml") + "\n"
                    "x: &defaults {steps: 5, batch_size: 2}\ntrain:\n  <<: *defaults\n  steps: 7\n")
    with pytest.raises(ConfigError, match="x: unknown key"):  # the loader accepted the file; the schema refuses x
        load_config(str(path))
