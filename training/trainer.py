"""The model's jitted, sharded train and eval steps over pure pytrees (Trainer), and the validation loss."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from mixerlab.models.decoder import Decoder, cross_entropy
from mixerlab.training import flop_model, mesh as mesh_lib, remat_auto
from mixerlab.training.optim import make_optimizer, schedule

BATCH_KEYS = ("inputs", "targets", "segment_ids", "positions", "loss_mask")


class Trainer:
    """The model split into (graphdef, params, rest) and jitted, sharded steps over pure pytrees.

    Parameters are created directly in their shardings (a jitted init), so no host holds the full model.
    """

    def __init__(self, cfg, vocab_size: int, mesh=None):
        self.mesh = mesh if mesh is not None else mesh_lib.make_mesh(cfg)
        cfg = remat_auto.resolve(cfg, vocab_size, self.mesh)  # model.remat=auto: the fastest policy that fits
        self.cfg = cfg
        seed = cfg.train.seed
        abstract = nnx.eval_shape(lambda: Decoder(cfg.model, vocab_size, mixer_options=cfg.mixers,
                                                  rngs=nnx.Rngs(seed)))
        self.graphdef, abstract_params, abstract_rest = nnx.split(abstract, nnx.Param, ...)
        self.abstract_params = nnx.to_pure_dict(abstract_params)  # ShapeDtypeStructs
        self.tx = make_optimizer(cfg, abstract_params)  # groups from the Variable types
        self.lr = schedule(cfg)
        replicated = mesh_lib.replicated(self.mesh)
        self.param_shardings = mesh_lib.param_shardings(self.abstract_params, self.mesh, cfg, vocab_size)
        self.opt_shardings = mesh_lib.follow_param_shardings(
            jax.eval_shape(self.tx.init, self.abstract_params), self.abstract_params, self.param_shardings,
            replicated)
        self.abstract_rest = nnx.to_pure_dict(abstract_rest)
        self.rest_shardings = jax.tree.map(lambda _: replicated, self.abstract_rest)
        self.batch_sharding = mesh_lib.batch_sharding(self.mesh)
        # The key is an argument, not a constant: with a constant key XLA constant-folds the random draws of
        # every weight at compile time (minutes for a 1.34B model on GPU).
        self._init_fn = lambda key: self._split(Decoder(cfg.model, vocab_size, mixer_options=cfg.mixers,
                                                        rngs=nnx.Rngs(key)))
        self._seed = seed
        metric_sh = replicated
        self.train_step = jax.jit(self._train_step, donate_argnums=(0, 1),
                                  in_shardings=(self.param_shardings, self.opt_shardings, self.batch_sharding),
                                  out_shardings=(self.param_shardings, self.opt_shardings, metric_sh))
        self.eval_step = jax.jit(self._eval_step, in_shardings=(self.param_shardings, self.batch_sharding),
                                 out_shardings=(metric_sh, metric_sh))
        self.params = self.opt_state = self.rest = None

    @staticmethod
    def _split(model):
        _, params, rest = nnx.split(model, nnx.Param, ...)
        return nnx.to_pure_dict(params), nnx.to_pure_dict(rest)

    def initialize(self) -> None:
        """Draws the parameters (from train.seed) in their shardings and initialises the optimizer."""
        self.params, self.rest = jax.jit(self._init_fn, out_shardings=(self.param_shardings, self.rest_shardings))(
            jax.random.key(self._seed))
        self.opt_state = jax.jit(self.tx.init, out_shardings=self.opt_shardings)(self.params)

    def _model(self, params):
        return nnx.merge(self.graphdef, params, self.rest)

    def _loss(self, params, batch):
        model = self._model(params)
        chunk = self.cfg.train.loss_chunk
        with jax.sharding.use_abstract_mesh(self.mesh.abstract_mesh):  # lets ops shard_map their kernels
            if chunk and chunk < batch["inputs"].shape[1]:
                hidden = model.hidden(batch["inputs"], segment_ids=batch["segment_ids"],
                                      positions=batch["positions"])
                return model.chunked_loss(hidden, batch["targets"], batch["loss_mask"], chunk)
            logits = model(batch["inputs"], segment_ids=batch["segment_ids"], positions=batch["positions"])
        return cross_entropy(logits, batch["targets"], batch["loss_mask"])

    def _summed_loss(self, params, batch):
        loss, count = self._loss(params, batch)
        return loss * count, count

    def _loss_and_grads(self, params, batch):
        """Mean token loss and its gradient; with train.microbatches = n the batch is split into n
        strided micro-batches (rows j, j+n, ...: every device keeps its share) scanned with summed gradients."""
        n = self.cfg.train.microbatches
        grad_fn = jax.value_and_grad(self._summed_loss, has_aux=True)
        if n == 1:
            (total, count), grads = grad_fn(params, batch)
        else:
            micro = jax.tree.map(lambda x: jnp.swapaxes(x.reshape(x.shape[0] // n, n, *x.shape[1:]), 0, 1), batch)

            def body(carry, mb):
                (t1, c1), g1 = grad_fn(params, mb)
                t0, c0, g0 = carry
                return (t0 + t1, c0 + c1, jax.tree.map(jnp.add, g0, g1)), None

            zero = jnp.zeros((), jnp.float32)
            (total, count, grads), _ = jax.lax.scan(body, (zero, zero, jax.tree.map(jnp.zeros_like, params)), micro)
        denom = jnp.maximum(count, 1.0)
        return (total / denom, count), jax.tree.map(lambda g: g / denom, grads)

    def _train_step(self, params, opt_state, batch):
        (loss, count), grads = self._loss_and_grads(params, batch)
        grad_norm = optax.global_norm(grads)
        updates, new_opt_state = self.tx.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        # A non-finite loss or gradient leaves parameters and optimizer state untouched (the step is skipped).
        ok = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(ok, a, b), new, old)
        metrics = {"loss": loss, "grad_norm": grad_norm, "tokens": count, "skipped": 1.0 - ok.astype(jnp.float32),
                   "attention_pairs": flop_model.causal_pairs(batch["segment_ids"])}  # this batch's attention work
        return keep(new_params, params), keep(new_opt_state, opt_state), metrics

    def _eval_step(self, params, batch):
        loss, count = self._loss(params, batch)
        return loss * count, count

    def global_batch(self, local: dict) -> dict:
        """This process's rows -> global arrays sharded over (data, fsdp)."""
        return {k: jax.make_array_from_process_local_data(self.batch_sharding, np.asarray(local[k]))
                for k in BATCH_KEYS}

    def lower_abstract_step(self):
        """The train step lowered on abstract, sharded arguments (nothing drawn or placed): for compile-time
        questions (does it fit, what does it cost). Non-parameter state (none in our models today) becomes a
        compile-time constant of zeros unless the trainer was initialized."""
        abstract = lambda tree, shardings: jax.tree.map(  # noqa: E731
            lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), tree, shardings)
        params = abstract(self.abstract_params, self.param_shardings)
        opt = abstract(jax.eval_shape(self.tx.init, self.abstract_params), self.opt_shardings)
        batch = self.abstract_batch(self.cfg.train.batch_size, self.cfg.data.seq_len)
        if self.rest is None:
            self.rest = jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), self.abstract_rest)
        return self.train_step.lower(params, opt, batch)

    def abstract_batch(self, global_batch_size: int, seq_len: int) -> dict:
        shape = (global_batch_size, seq_len)
        dtypes = {"inputs": jnp.int32, "targets": jnp.int32, "segment_ids": jnp.int32, "positions": jnp.int32,
                  "loss_mask": jnp.float32}
        return {k: jax.ShapeDtypeStruct(shape, dtypes[k], sharding=self.batch_sharding) for k in BATCH_KEYS}


def evaluate(trainer: Trainer, batches: list[dict]) -> dict:
    total, count = 0.0, 0.0
    for batch in batches:
        s, c = trainer.eval_step(trainer.params, trainer.global_batch(batch))
        total += float(s)
        count += float(c)
    loss = total / max(count, 1.0)
    return {"loss": loss, "perplexity": math.exp(min(loss, 50.0)), "tokens": count}
