"""What every token mixer is: its constructor arguments and the methods the decoder calls.

A mixer is a Flax NNX module built as ``Mixer(spec, options, rngs=rngs)`` where ``spec`` carries the model
dimensions (the same for every mixer) and ``options`` is the mixer's own frozen dataclass of flags (registered
next to it in ``mixers/registry.py``; each field is a config key ``mixers.<name>.<field>``).

Calls:
  ``mixer(x_BTD, segment_ids=seg_BT, positions=pos_BT) -> y_BTD``
      Training/prefill forward. ``segment_ids`` mark packed documents (0 = padding); no information may cross
      a boundary. ``positions`` restart at 0 in every document.
  ``mixer.init_cache(batch_size, max_length) -> cache``   (a pytree of arrays)
  ``mixer.decode(x_B1D, cache, positions_B) -> (y_B1D, cache)``
      One token per row. Running ``decode`` over a sequence must equal the parallel forward.
  ``mixer.extend(x_BCD, cache, positions_BC) -> (y_BCD, cache)``   (optional)
      C tokens of one document per row continuing ``cache``, in parallel (chunked prefill): the same as C
      ``decode`` steps. A row whose first position is 0 starts from an empty cache. The decoder runs
      ``decode`` over the chunk for a mixer without it (``Decoder.prefill``).

Parameter kinds (the optimizer reads them; see training/optim.py):
  * ``nnx.Param`` — ordinary weights, weight-decayed when they are matrices (ndim >= 2).
  * ``DynamicsParam`` — gate/SSM dynamics (A_log, dt_bias, decay biases, static gains): never weight-decayed.
  * ``SSMParam`` — state-space parameters of S4D-style layers: never decayed and in the ``ssm`` LR-cap group.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Protocol, runtime_checkable

import jax.numpy as jnp
from flax import nnx


class DynamicsParam(nnx.Param):
    """Gate / decay dynamics parameter (no weight decay)."""


class SSMParam(DynamicsParam):
    """State-space parameter: no weight decay, learning rate capped by ``optim.ssm_lr_cap``."""


@dataclasses.dataclass(frozen=True)
class MixerSpec:
    """Dimensions shared by every mixer of a model."""

    d_model: int
    num_heads: int
    head_dim: int  # query/key width per head (d_k)
    value_head_dim: int  # value width per head (d_v)
    layer_index: int
    num_layers: int
    dtype: Any = jnp.float32  # compute dtype of activations; parameters stay float32
    init_std: float = 0.02

    @property
    def out_init_std(self) -> float:
        """Residual output projections: std 0.02 / sqrt(2 L) (GPT-2 / Llama convention)."""
        return self.init_std / (2.0 * self.num_layers) ** 0.5


@runtime_checkable
class Mixer(Protocol):
    """The methods the decoder calls on every mixer (this module's docstring says what each must do); a test
    checks that every registered mixer implements them."""

    def __call__(self, x_BTD, *, segment_ids, positions): ...

    def init_cache(self, batch_size: int, max_length: int): ...

    def decode(self, x_B1D, cache, positions_B): ...


def reset_rows(cache: dict, positions_B) -> dict:
    """The cache with every row whose position is 0 (a new document) zeroed: ``decode`` and ``extend`` start
    a document there."""
    reset = positions_B == 0
    return {n: jnp.where(reset.reshape((-1,) + (1,) * (c.ndim - 1)), jnp.zeros_like(c), c) for n, c in cache.items()}
