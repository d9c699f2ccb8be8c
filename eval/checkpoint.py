"""Load a trained run for evaluation: its config, tokenizer and the parameters of one checkpoint.

``load_run(path, step=None) -> LoadedRun(cfg, model, tokenizer, step)``

``path`` is a run directory (``train.output_dir``: ``config.yaml`` + ``checkpoints/``) or its ``checkpoints``
directory (the run's ``config.yaml`` is then read from the parent). ``step=None`` takes the newest checkpoint.
Only the ``params`` item of the orbax Composite written by ``training.checkpoint.Checkpointer`` is read (an
orbax partial restore): the optimizer state is never loaded. The model is the run's ``models.decoder.Decoder``
(same config, same vocabulary rule as ``training.loop.train``) with the restored float32 parameters on the
default device.
"""
from __future__ import annotations

import dataclasses
import os

import jax
from flax import nnx

from mixerlab.models.decoder import Decoder, abstract_model, build_model
from mixerlab.training.checkpoint import Checkpointer
from mixerlab.training.config import Config, load_config
from mixerlab.training.tokenizer import Tokenizer, load_tokenizer

CONFIG_FILE = "config.yaml"
CHECKPOINT_DIR = "checkpoints"


@dataclasses.dataclass
class LoadedRun:
    cfg: Config
    model: Decoder
    tokenizer: Tokenizer
    step: int


def _listing(path: str) -> str:
    try:
        names = sorted(os.listdir(path))
    except OSError as e:
        return f"(cannot list it: {e.strerror})"
    return ", ".join(names[:20]) + (f", ... ({len(names)} entries)" if len(names) > 20 else "") if names else "nothing"


def resolve_run_dirs(path: str) -> tuple[str, str]:
    """(run directory, checkpoint directory) for a run directory or its checkpoint directory."""
    p = os.path.abspath(os.path.expanduser(path))
    if not os.path.isdir(p):
        raise FileNotFoundError(f"run path {path!r}: no such directory (expected a run directory with "
                                f"{CONFIG_FILE} and {CHECKPOINT_DIR}/, or its {CHECKPOINT_DIR}/ directory)")
    if os.path.isfile(os.path.join(p, CONFIG_FILE)):
        ckpt = os.path.join(p, CHECKPOINT_DIR)
        if not os.path.isdir(ckpt):
            raise FileNotFoundError(f"run path {path!r}: has {CONFIG_FILE} but no {CHECKPOINT_DIR}/ directory; "
                                    f"it holds: {_listing(p)}")
        return p, ckpt
    parent = os.path.dirname(p)
    if os.path.isfile(os.path.join(parent, CONFIG_FILE)):
        return parent, p
    raise FileNotFoundError(f"run path {path!r}: neither it nor its parent holds {CONFIG_FILE}; expected a run "
                            f"directory (train.output_dir) or its {CHECKPOINT_DIR}/ directory. It holds: {_listing(p)}")


def _single_device_template(abstract_params):
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=device), abstract_params)


def load_run(path: str, step: int | None = None) -> LoadedRun:
    """The run's config, tokenizer and model with the parameters of checkpoint ``step`` (default: newest)."""
    run_dir, ckpt_dir = resolve_run_dirs(path)
    config_path = os.path.join(run_dir, CONFIG_FILE)
    try:
        cfg = load_config(config_path)
    except ValueError as e:
        raise ValueError(f"run {run_dir!r}: {CONFIG_FILE} does not load with this code version: {e}") from e
    tokenizer = load_tokenizer(cfg.data.tokenizer.kind, cfg.data.tokenizer.path)
    vocab_size = cfg.model.vocab_size or tokenizer.vocab_size

    checkpointer = Checkpointer(ckpt_dir, keep=cfg.checkpoint.keep, async_save=False)
    try:
        steps = checkpointer.steps()
        if not steps:
            raise FileNotFoundError(f"checkpoint directory {ckpt_dir!r} holds no checkpoint (found: "
                                    f"{_listing(ckpt_dir)})")
        if step is None:
            step = steps[-1]
        elif step not in steps:
            raise ValueError(f"checkpoint step {step} is not in {ckpt_dir!r}; available steps: "
                             f"{', '.join(map(str, steps))}")
        graphdef, abstract_params, _ = nnx.split(abstract_model(cfg, vocab_size), nnx.Param, ...)
        template = _single_device_template(nnx.to_pure_dict(abstract_params))
        try:
            restored_params = checkpointer.restore_params(step, template)
        except Exception as e:  # orbax raises many types (missing item, shape mismatch, truncated files)
            raise ValueError(f"checkpoint step {step} in {ckpt_dir!r} could not be restored as the parameters of "
                             f"the model in {config_path!r} ({type(e).__name__}: {e})") from e
    finally:
        checkpointer.close()

    # Non-parameter state (none today) comes from the model's own init; jit drops the unused parameter init.
    rest = jax.jit(lambda: nnx.split(build_model(cfg, vocab_size), nnx.Param, ...)[2])()
    nnx.replace_by_pure_dict(abstract_params, restored_params)
    model = nnx.merge(graphdef, abstract_params, rest)
    return LoadedRun(cfg=cfg, model=model, tokenizer=tokenizer, step=int(step))
