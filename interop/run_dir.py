"""Run directories <-> HF directories.

Export reads a run the way evaluation does (``eval.checkpoint.load_run``: config.yaml + the newest or a chosen
orbax step, parameters only). Import writes a run directory that evaluation, generation and the trainer read:
``config.yaml`` (train.output_dir = the run directory) and ``checkpoints/<step>/`` through the trainer's own
``Checkpointer``, with the imported parameters, a freshly initialised optimizer state (the optimizer of the
config, as at step 0) and a data position at the start of the training data. ``train.resume=true`` then continues
training from the imported weights; the tokenizer file is copied into the run directory.
"""
from __future__ import annotations

import os
import shutil

import jax
import yaml
from flax import nnx

from mixerlab.interop.hf_dir import export_model, import_model

DATA_STATE_VERSION = 1  # training/data.py's iterator state format (a position counted from the start)


def export_run(run_path: str, out_dir: str, step: int | None = None, *, notes: list | None = None) -> tuple[str, int]:
    """(model_type written, checkpoint step exported) for the run at ``run_path`` (a run directory or its
    ``checkpoints`` directory); ``step=None`` takes the newest checkpoint."""
    from mixerlab.eval.checkpoint import load_run

    run = load_run(run_path, step)
    return export_model(run.model, run.cfg, out_dir, notes=notes), run.step


def import_run(hf_dir: str, run_dir: str, step: int = 0) -> str:
    """Writes ``run_dir`` (config.yaml + checkpoints/<step>) from an HF directory; returns the mixer names
    ("+"-joined for a hybrid)."""
    from mixerlab.training.checkpoint import Checkpointer
    from mixerlab.training.config import from_dict
    from mixerlab.training.optim import make_optimizer

    cfg, model = import_model(hf_dir)
    run_dir = os.path.abspath(run_dir)
    ckpt_dir = os.path.join(run_dir, "checkpoints")
    if os.path.exists(ckpt_dir) and os.listdir(ckpt_dir):
        raise FileExistsError(f"{ckpt_dir!r} already holds checkpoints; import into a new run directory")
    os.makedirs(run_dir, exist_ok=True)
    raw = cfg.to_dict()
    tok = raw["data"]["tokenizer"]
    if tok["path"]:
        local = os.path.join(run_dir, os.path.basename(tok["path"]))
        shutil.copyfile(tok["path"], local)
        tok["path"] = local
    raw["train"]["output_dir"] = run_dir
    cfg = from_dict(raw)
    with open(os.path.join(run_dir, "config.yaml"), "w") as f:
        yaml.safe_dump(cfg.to_dict(), f, sort_keys=False)

    _, params_state, _ = nnx.split(model, nnx.Param, ...)
    params = nnx.to_pure_dict(params_state)
    opt_state = jax.jit(make_optimizer(cfg, params_state).init)(params)
    data_state = {"per_process": [{"version": DATA_STATE_VERSION, "batches_from_start": 0}]}
    meta = {"step": step, "val_loss": None, "config": cfg.to_dict(), "imported_from": os.path.abspath(hf_dir)}
    checkpointer = Checkpointer(ckpt_dir, keep=max(cfg.checkpoint.keep, 1), async_save=False)
    try:
        if not checkpointer.save(step, params=params, opt_state=opt_state, data_state=data_state, meta=meta):
            raise ValueError(f"{hf_dir!r}: the imported parameters are not all finite; nothing was saved")
    finally:
        checkpointer.close()
    return "+".join(sorted(set(cfg.model.layer_mixers)))
