"""Activation sharding: batch rows over the mesh's (data, fsdp) axes.

Without these constraints XLA's sharding propagation may follow the FSDP-sharded weights instead of the
batch-sharded inputs and keep activations replicated over fsdp: the TPU AOT compile of a 2-layer Muir at one
sequence per chip held bf16 logits of the *global* batch on every chip ([16, 2048, 32000] on 16 chips), so
the temporaries grew with the slice (docs/benchmarks/aot_compile.md). Only the batch dimension is pinned;
the others stay for XLA to choose (e.g. heads or vocabulary over ``tensor``).
"""
from __future__ import annotations

import math

import jax
from jax.sharding import NamedSharding, PartitionSpec as P

BATCH_AXES = ("data", "fsdp")  # training/mesh.py shards the input batch over the same axes


def constrain_batch(x: jax.Array) -> jax.Array:
    """``x`` [B, ...] with B sharded over the (data, fsdp) axes of the current mesh; a no-op without a mesh
    (``jax.sharding.use_abstract_mesh``, set by the trainer), on one device, or when B does not divide."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1:
        return x
    axes = tuple(a for a in BATCH_AXES if a in mesh.axis_names and mesh.shape[a] > 1)
    if not axes or x.shape[0] % math.prod(mesh.shape[a] for a in axes):
        return x
    spec = P(axes, *([P.UNCONSTRAINED] * (x.ndim - 1)))
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))
