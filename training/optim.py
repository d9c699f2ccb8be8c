"""AdamW with linear warmup + cosine decay, global-norm clipping, a weight-decay mask and LR caps per group.

Parameter groups come from the parameter's NNX type (mixers/base.py):
  * matrices (ndim >= 2) of plain ``nnx.Param`` — weight-decayed;
  * vectors (norm scales, biases) and every ``DynamicsParam`` (A_log, dt_bias, gate biases, static gains) —
    no weight decay;
  * ``SSMParam`` — no weight decay and learning rate min(schedule, optim.ssm_lr_cap) (the IA / Mamba recipe).
"""
from __future__ import annotations

import jax
import optax
from flax import nnx

from mixerlab.mixers.base import DynamicsParam, SSMParam


def schedule(cfg) -> optax.Schedule:
    o, steps = cfg.optim, cfg.train.steps
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=o.lr, warmup_steps=o.warmup_steps,
        decay_steps=max(steps, o.warmup_steps + 1), end_value=o.lr * o.min_lr_ratio)


def param_groups(params_state) -> dict:
    """Pure dict of the same structure as the parameters with a group label per leaf."""

    def label(v):
        if isinstance(v, SSMParam):
            return "ssm"
        if isinstance(v, DynamicsParam) or v.ndim < 2:
            return "no_decay"
        return "decay"

    labels = jax.tree.map(label, params_state, is_leaf=lambda x: isinstance(x, nnx.Variable))
    return nnx.to_pure_dict(labels) if isinstance(labels, nnx.State) else labels


def make_optimizer(cfg, params_state) -> optax.GradientTransformation:
    o = cfg.optim
    lr = schedule(cfg)
    adam = lambda sched, wd: optax.adamw(sched, b1=o.b1, b2=o.b2, eps=o.eps, weight_decay=wd)
    ssm_lr = lr if o.ssm_lr_cap is None else (lambda step: jax.numpy.minimum(lr(step), o.ssm_lr_cap))
    groups = {"decay": adam(lr, o.weight_decay), "no_decay": adam(lr, 0.0), "ssm": adam(ssm_lr, 0.0)}
    chain = [optax.clip_by_global_norm(o.grad_clip)] if o.grad_clip is not None else []
    chain.append(optax.multi_transform(groups, param_groups(params_state)))
    return optax.chain(*chain)
