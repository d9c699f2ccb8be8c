"""Typed, validated experiment configuration.

A config is ``configs/base.yaml`` deep-merged with an experiment file (which names its parent with
``inherit: base.yaml``) and then with dotted command-line overrides (``model.mixer=gdn2 train.steps=200``).
Every key is checked against the dataclasses below: an unknown key, a wrong type or an impossible combination
raises ONE ``ConfigError`` that names the key, the bad value and what is allowed.

Per-mixer flags live under ``mixers.<name>.<field>``; their schema is each mixer's options dataclass in the
registry (mixers/registry.py), so a new mixer brings its own keys without touching this file.
"""
from __future__ import annotations

import copy
import dataclasses
import math
import os
import types
import typing
from typing import Any, Literal, Union

import yaml


class ConfigError(ValueError):
    """A bad configuration; the message names the key, the value and what is allowed."""


# --------------------------------------------------------------------------------------------- schema
@dataclasses.dataclass(frozen=True)
class TokenizerConfig:
    kind: Literal["byte", "hf", "sentencepiece"] = "hf"
    path: str | None = "data/embedded/tokenizer.json"  # tokenizer.json (hf) or .model (sentencepiece)


@dataclasses.dataclass(frozen=True)
class DataConfig:
    train_path: str = "data/embedded/train"  # directory, .parquet file or glob
    val_path: str | None = "data/embedded/val"
    text_column: str = "text"
    seq_len: int = 256
    shuffle: bool = True
    num_workers: int = 0
    tokenizer: TokenizerConfig = TokenizerConfig()
    format: Literal["text", "pretokenized"] = "text"  # pretokenized: *_path name token-shard directories


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    mixer: str = "softmax"  # a registered mixer name (mixers/registry.py)
    layer_pattern: tuple[str, ...] | None = None  # e.g. [gdn2, gdn2, gdn2, softmax]; tiled over the layers
    vocab_size: int | None = None  # None: the tokenizer's vocabulary size
    d_model: int = 192
    num_layers: int = 4
    num_heads: int = 3
    head_dim: int | None = None  # None: d_model // num_heads
    value_head_dim: int | None = None  # None: head_dim
    ffn_kind: Literal["swiglu", "mlp"] = "swiglu"  # mlp = 2-matrix FFN (the Muir tables' accounting)
    ffn_activation: Literal["silu", "gelu", "relu2"] = "gelu"  # activation of the 2-matrix mlp
    ffn_dim: int = 512
    norm_eps: float = 1e-6
    tie_embeddings: bool = False
    init_std: float = 0.02
    dtype: Literal["float32", "bfloat16"] = "float32"  # activation/compute dtype; parameters stay float32
    residual_dtype: Literal["float32", "bfloat16"] | None = "float32"  # the residual stream between blocks (and the
    #   norms on it); None: model.dtype. float32 is what torch autocast keeps; the branches compute in model.dtype
    #   (docs/benchmarks/parity_h200.md)
    remat: Literal["none", "block", "kernels", "dots", "mixer", "auto"] = "none"  # activation checkpointing, per
    #   block: keep only its input; kernels: + the mixer kernels' outputs/residuals; dots: + every matmul output;
    #   mixer: recompute only the token mixer; auto: the fastest of none/dots/kernels/block whose compiled train
    #   step fits the device (training/remat_auto.py)

    @property
    def key_head_dim(self) -> int:
        """Query/key width per head: head_dim, or d_model // num_heads when unset."""
        return self.head_dim or self.d_model // self.num_heads

    @property
    def value_width(self) -> int:
        """Value width per head: value_head_dim, or the key width when unset."""
        return self.value_head_dim or self.key_head_dim

    @property
    def layer_mixers(self) -> tuple[str, ...]:
        """The mixer name of every layer (layer_pattern tiled, or mixer everywhere)."""
        pattern = self.layer_pattern or (self.mixer,)
        return tuple(pattern[i % len(pattern)] for i in range(self.num_layers))


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    lr: float = 3e-3
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    warmup_steps: int = 30
    weight_decay: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    grad_clip: float | None = 1.0  # global-norm clip; null disables
    ssm_lr_cap: float | None = None  # LR cap for mixers.base.SSMParam parameters (IA recipe: 1e-3)


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    every: int = 100  # steps between checkpoints; 0 disables
    keep: int = 3
    async_save: bool = False


@dataclasses.dataclass(frozen=True)
class ShardingRules:
    """Mesh axis (data | fsdp | tensor) or null for each logical parameter dimension (training/mesh.py)."""

    embed: Literal["data", "fsdp", "tensor"] | None = "fsdp"
    hidden: Literal["data", "fsdp", "tensor"] | None = "tensor"
    vocab: Literal["data", "fsdp", "tensor"] | None = "tensor"


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    data: int = -1  # devices per slice on each axis; -1 = all remaining
    fsdp: int = 1
    tensor: int = 1
    dcn_data: int = 1  # slices (multislice over DCN) on the data axis
    dcn_fsdp: int = 1
    rules: ShardingRules = ShardingRules()


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    steps: int = 300
    batch_size: int = 8  # global, in sequences
    microbatches: int = 1  # gradient accumulation: the batch runs as this many sequential micro-batches
    loss_chunk: int = 0  # tokens per slice of the output layer + loss (recomputed in the backward); 0 = all of T
    seed: int = 0
    log_every: int = 10
    eval_every: int = 100  # 0 disables periodic validation
    eval_batches: int = 8
    output_dir: str = "runs/base"
    resume: bool = True  # continue from the newest checkpoint in output_dir if there is one
    max_consecutive_skips: int = 5  # stop after this many non-finite steps in a row (each is skipped)
    prefetch: int = 2  # batches built and put on the devices ahead of the step; 0: built after each step
    gpu_memory_fraction: float | None = 0.9  # share of each GPU's memory JAX's allocator may take (its default:
    #                                          0.75); XLA_PYTHON_CLIENT_MEM_FRACTION in the environment wins; null:
    #                                          JAX's default


@dataclasses.dataclass(frozen=True)
class ProfileConfig:
    start_step: int = 0  # first profiled step (0 = no profile)
    num_steps: int = 3
    all_hosts: bool = False  # profile every host, not only process 0


@dataclasses.dataclass(frozen=True)
class LoggingConfig:
    wandb: bool = False  # also log the metrics to Weights & Biases (training/tracking.py)
    wandb_project: str = "mixerlab"
    wandb_run_name: str | None = None  # None: the name of train.output_dir
    wandb_mode: Literal["online", "offline"] = "online"  # offline: files only, `wandb sync` uploads them


@dataclasses.dataclass(frozen=True)
class Config:
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    optim: OptimConfig = OptimConfig()
    train: TrainConfig = TrainConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    mesh: MeshConfig = MeshConfig()
    profile: ProfileConfig = ProfileConfig()
    logging: LoggingConfig = LoggingConfig()
    mixers: types.MappingProxyType = dataclasses.field(default_factory=lambda: types.MappingProxyType({}))

    # -- derived values used across the code base
    @property
    def head_dim(self) -> int:
        return self.model.key_head_dim

    @property
    def value_head_dim(self) -> int:
        return self.model.value_width

    @property
    def layer_mixers(self) -> tuple[str, ...]:
        return self.model.layer_mixers

    def mixer_options(self, name: str):
        from mixerlab.mixers import registry

        return self.mixers.get(name) or registry.get(name).options()

    def to_dict(self) -> dict:
        out = {f.name: _to_plain(getattr(self, f.name)) for f in dataclasses.fields(self) if f.name != "mixers"}
        out["mixers"] = {k: _to_plain(v) for k, v in self.mixers.items()}
        return out


def _to_plain(value):
    if dataclasses.is_dataclass(value):
        return {f.name: _to_plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, tuple):
        return [_to_plain(v) for v in value]
    return value


# --------------------------------------------------------------------------------------------- loading
def load_config(path: str | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Reads a YAML file (following ``inherit:`` chains), applies ``a.b=value`` overrides, validates."""
    raw: dict = {}
    if path is not None:
        raw = _read_yaml_chain(path, seen=())
    for item in overrides:
        key, value = _parse_override(item)
        _set_dotted(raw, key, value)
    return from_dict(raw)


def _read_yaml_chain(path: str, seen: tuple[str, ...]) -> dict:
    if not os.path.isfile(path):
        raise ConfigError(f"config file {path!r} does not exist")
    real = os.path.realpath(path)
    if real in seen:
        raise ConfigError(f"config file {path!r}: 'inherit' forms a cycle ({' -> '.join(seen + (real,))})")
    with open(path) as f:
        try:
            data = yaml.load(f, Loader=_UniqueKeyLoader) or {}
        except _DuplicateKey as e:
            raise ConfigError(f"config file {path!r}, line {e.line}: key {e.key!r} appears twice in the same "
                              f"mapping (first on line {e.first_line}); YAML would keep only the last one, so "
                              f"merge the two") from None
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {path!r} is not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path!r} must hold a mapping at the top level, got {type(data).__name__}")
    parent = data.pop("inherit", None)
    if parent is None:
        return data
    if not isinstance(parent, str):
        raise ConfigError(f"config file {path!r}: 'inherit' must be a file name, got {parent!r}")
    parent_path = parent if os.path.isabs(parent) else os.path.join(os.path.dirname(path), parent)
    return _deep_merge(_read_yaml_chain(parent_path, seen + (real,)), data)


class _DuplicateKey(Exception):
    def __init__(self, key, line: int, first_line: int):
        super().__init__(key)
        self.key, self.line, self.first_line = key, line, first_line


class _UniqueKeyLoader(yaml.SafeLoader):
    """yaml.SafeLoader that refuses a key given twice in one mapping, at any depth (plain YAML keeps the last
    one silently: a second ``train:`` section would drop the first)."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen = {}
            for key_node, _value in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":  # <<: *anchor; overriding a merged key is fine
                    continue
                key = self.construct_object(key_node, deep=True)
                line = key_node.start_mark.line + 1
                try:
                    if key in seen:
                        raise _DuplicateKey(key, line, seen[key])
                except TypeError:  # an unhashable key: SafeLoader's own error follows
                    continue
                seen[key] = line
        return super().construct_mapping(node, deep=deep)


def _deep_merge(base: dict, top: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in top.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _deep_merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def _parse_override(item: str) -> tuple[str, Any]:
    if "=" not in item or item.startswith("="):
        raise ConfigError(f"override {item!r} must look like section.key=value (e.g. model.mixer=gdn2)")
    key, text = item.split("=", 1)
    try:
        value = yaml.safe_load(text) if text != "" else ""
    except yaml.YAMLError:
        value = text
    return key.strip(), value


def _set_dotted(raw: dict, key: str, value: Any) -> None:
    parts = key.split(".")
    node = raw
    for i, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {key}: {'.'.join(parts[: i + 1])} is a value, not a section")
        node = child
    node[parts[-1]] = value


# --------------------------------------------------------------------------------------------- typing
def from_dict(raw: dict) -> Config:
    from mixerlab.mixers import registry

    if not isinstance(raw, dict):
        raise ConfigError(f"config must be a mapping, got {type(raw).__name__}")
    raw = dict(raw)
    mixer_raw = raw.pop("mixers", None) or {}
    if not isinstance(mixer_raw, dict):
        raise ConfigError(f"mixers: must be a mapping of mixer name -> options, got {mixer_raw!r}")
    mixers = {}
    for name, opts in mixer_raw.items():
        if name not in registry.names():
            raise ConfigError(f"mixers.{name}: unknown mixer {name!r}; registered mixers: "
                              f"{', '.join(registry.names())}")
        mixers[name] = _build(registry.get(name).options, opts or {}, f"mixers.{name}")
    sections = _build(Config, raw, "")
    cfg = dataclasses.replace(sections, mixers=types.MappingProxyType(mixers))
    validate(cfg)
    return cfg


def _build(cls, raw: Any, where: str):
    if not isinstance(raw, dict):
        raise ConfigError(f"{where or 'config'}: expected a mapping of keys, got {raw!r}")
    fields = {f.name: f for f in dataclasses.fields(cls) if f.name != "mixers"}
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        key = f"{where}.{unknown[0]}" if where else unknown[0]
        raise ConfigError(f"{key}: unknown key; valid keys{(' of ' + where) if where else ''}: "
                          f"{', '.join(sorted(fields))}")
    hints = typing.get_type_hints(cls)
    values = {}
    for name, value in raw.items():
        key = f"{where}.{name}" if where else name
        values[name] = _coerce(hints[name], value, key)
    try:
        return cls(**values)
    except ConfigError:
        raise
    except (ValueError, TypeError) as e:  # an options dataclass rejecting a combination in __post_init__
        msg = str(e)
        raise ConfigError(msg if where and where in msg else f"{where or 'config'}: {msg}") from None


def _type_name(tp) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        return " or ".join("null" if a is type(None) else _type_name(a) for a in typing.get_args(tp))
    if origin is tuple:
        return f"a list of {_type_name(typing.get_args(tp)[0])}"
    if dataclasses.is_dataclass(tp):
        return "a mapping"
    return getattr(tp, "__name__", str(tp))


def _coerce(tp, value, key: str):
    origin = typing.get_origin(tp)
    bad = ConfigError(f"{key}: got {value!r} ({type(value).__name__}); expected {_type_name(tp)}")
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, key)
    if origin is Literal:
        if value in typing.get_args(tp) and type(value) is type(typing.get_args(tp)[0]):
            return value
        raise bad
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None:
            if type(None) in args:
                return None
            raise bad
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(arg, value, key)
            except ConfigError:
                continue
        raise bad
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise bad
        (item_tp, *_rest) = typing.get_args(tp)
        return tuple(_coerce(item_tp, v, f"{key}[{i}]") for i, v in enumerate(value))
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise bad
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise bad
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads "3e-4" as a string
            try:
                return float(value)
            except ValueError:
                raise bad from None
        raise bad
    if tp is str:
        if isinstance(value, str):
            return value
        raise bad
    raise ConfigError(f"{key}: field type {tp!r} is not supported by the config system")


# --------------------------------------------------------------------------------------------- checks
def validate(cfg: Config) -> None:
    """Cross-field checks: one ConfigError for the first impossible combination."""
    from mixerlab.mixers import registry

    m, d, t, o = cfg.model, cfg.data, cfg.train, cfg.optim
    positive = {
        "model.d_model": m.d_model, "model.num_layers": m.num_layers, "model.num_heads": m.num_heads,
        "model.ffn_dim": m.ffn_dim, "data.seq_len": d.seq_len, "train.steps": t.steps,
        "train.batch_size": t.batch_size, "train.log_every": t.log_every, "checkpoint.keep": cfg.checkpoint.keep,
        "train.max_consecutive_skips": t.max_consecutive_skips, "train.microbatches": t.microbatches,
    }
    for key, value in positive.items():
        if value <= 0:
            raise ConfigError(f"{key}: got {value}; must be a positive integer")
    if cfg.profile.start_step < 0 or cfg.profile.num_steps < 1:
        raise ConfigError(f"profile: start_step must be >= 0 (0 = off) and num_steps >= 1, got "
                          f"{cfg.profile.start_step}, {cfg.profile.num_steps}")
    for key, value in {"train.eval_every": t.eval_every, "train.eval_batches": t.eval_batches,
                       "checkpoint.every": cfg.checkpoint.every, "optim.warmup_steps": o.warmup_steps,
                       "data.num_workers": d.num_workers, "train.prefetch": t.prefetch}.items():
        if value < 0:
            raise ConfigError(f"{key}: got {value}; must be >= 0")
    if t.loss_chunk < 0 or (t.loss_chunk and d.seq_len % t.loss_chunk):
        raise ConfigError(f"train.loss_chunk: got {t.loss_chunk}; must be 0 (off) or divide data.seq_len "
                          f"({d.seq_len})")
    if t.batch_size % t.microbatches:
        raise ConfigError(f"train.microbatches: got {t.microbatches}; must divide train.batch_size ({t.batch_size})")
    _check_ranges(cfg)
    if not 0.0 <= o.min_lr_ratio <= 1.0:
        raise ConfigError(f"optim.min_lr_ratio: got {o.min_lr_ratio}; must be in [0, 1]")
    if o.warmup_steps > t.steps:
        raise ConfigError(f"optim.warmup_steps: got {o.warmup_steps}; must be <= train.steps ({t.steps})")
    if t.gpu_memory_fraction is not None and not 0.0 < t.gpu_memory_fraction <= 1.0:
        raise ConfigError(f"train.gpu_memory_fraction: got {t.gpu_memory_fraction}; must be in (0, 1] or null "
                          "(JAX's default share, 0.75)")
    if o.ssm_lr_cap is not None and o.ssm_lr_cap <= 0:
        raise ConfigError(f"optim.ssm_lr_cap: got {o.ssm_lr_cap}; must be > 0 or null")
    if m.head_dim is None and m.d_model % m.num_heads:
        raise ConfigError(
            f"model.num_heads: got {m.num_heads}; it must divide model.d_model ({m.d_model}) "
            f"unless model.head_dim is set explicitly")
    for key, value in {"model.head_dim": m.head_dim, "model.value_head_dim": m.value_head_dim,
                       "model.vocab_size": m.vocab_size}.items():
        if value is not None and value <= 0:
            raise ConfigError(f"{key}: got {value}; must be a positive integer or null")
    names = registry.names()
    if m.mixer not in names:
        raise ConfigError(f"model.mixer: got {m.mixer!r}; registered mixers: {', '.join(names)}")
    if m.layer_pattern is not None:
        if not m.layer_pattern:
            raise ConfigError("model.layer_pattern: got an empty list; give mixer names or null")
        for i, name in enumerate(m.layer_pattern):
            if name not in names:
                raise ConfigError(f"model.layer_pattern[{i}]: got {name!r}; registered mixers: {', '.join(names)}")
        if m.num_layers % len(m.layer_pattern):
            raise ConfigError(
                f"model.layer_pattern: {len(m.layer_pattern)} entries do not tile model.num_layers ({m.num_layers}); "
                f"use a pattern whose length divides the number of layers")
    for key in ("data", "fsdp", "tensor"):
        value = getattr(cfg.mesh, key)
        if value == 0 or value < -1:
            raise ConfigError(f"mesh.{key}: got {value}; must be a positive device count or -1 (fill)")
    if [cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor].count(-1) > 1:
        raise ConfigError("mesh: at most one of mesh.data, mesh.fsdp, mesh.tensor may be -1")
    if cfg.logging.wandb and not cfg.logging.wandb_project.strip():
        raise ConfigError("logging.wandb_project: got an empty name; give a W&B project name")
    if cfg.logging.wandb_run_name is not None and not cfg.logging.wandb_run_name.strip():
        raise ConfigError("logging.wandb_run_name: got an empty name; give a name or null (train.output_dir's name)")
    for key in ("dcn_data", "dcn_fsdp"):
        if getattr(cfg.mesh, key) < 1:
            raise ConfigError(f"mesh.{key}: got {getattr(cfg.mesh, key)}; must be >= 1")
    for name, opts in cfg.mixers.items():
        check = getattr(opts, "validate", None)
        if check is not None:
            try:
                check(cfg)
            except ConfigError:
                raise
            except ValueError as e:  # mixers raise ValueError naming their own keys
                raise ConfigError(f"mixers.{name}: {e}") from None


def _check_ranges(cfg: Config) -> None:
    """Numeric keys with a meaningful domain; a value outside it would train silently wrong (eps=-1 leaves the
    loss flat, grad_clip=-1 turned clipping off) or fail deep inside numpy/optax without naming the key."""
    m, o, t = cfg.model, cfg.optim, cfg.train
    floats = {"optim.lr": o.lr, "optim.min_lr_ratio": o.min_lr_ratio, "optim.weight_decay": o.weight_decay,
              "optim.b1": o.b1, "optim.b2": o.b2, "optim.eps": o.eps, "optim.grad_clip": o.grad_clip,
              "optim.ssm_lr_cap": o.ssm_lr_cap, "model.init_std": m.init_std, "model.norm_eps": m.norm_eps}
    for key, value in floats.items():
        if value is not None and not math.isfinite(value):
            raise ConfigError(f"{key}: got {value}; must be a finite number")
    rules = [  # (key, value, ok, what is valid)
        ("optim.lr", o.lr, o.lr > 0, "must be > 0"),
        ("optim.b1", o.b1, 0.0 <= o.b1 < 1.0, "must be in [0, 1)"),
        ("optim.b2", o.b2, 0.0 <= o.b2 < 1.0, "must be in [0, 1)"),
        ("optim.eps", o.eps, o.eps > 0, "must be > 0"),
        ("optim.weight_decay", o.weight_decay, o.weight_decay >= 0, "must be >= 0"),
        ("optim.grad_clip", o.grad_clip, o.grad_clip is None or o.grad_clip > 0,
         "must be > 0 (the global gradient-norm limit) or null (no clipping)"),
        ("model.init_std", m.init_std, m.init_std > 0, "must be > 0"),
        ("model.norm_eps", m.norm_eps, m.norm_eps > 0, "must be > 0"),
        ("train.seed", t.seed, 0 <= t.seed < 2 ** 32, "must be in [0, 2**32)"),
    ]
    for key, value, ok, valid in rules:
        if not ok:
            raise ConfigError(f"{key}: got {value}; {valid}")
