"""Device mesh and parameter/batch shardings.

Mesh axes are ``(data, fsdp, tensor)``. Each has a size inside a slice (ICI: ``mesh.data``, ``mesh.fsdp``,
``mesh.tensor``; -1 on one axis = all remaining devices) and a number of slices it spans over DCN
(``mesh.dcn_data``, ``mesh.dcn_fsdp``; multislice). The batch is split over ``data × fsdp``.

Parameters are sharded by *logical-axis rules*. A parameter dimension's logical name says what it is:
``vocab`` (the vocabulary size), ``embed`` (the model width d_model) or ``hidden`` (any other width: heads ×
head dim, FFN width, gate ranks, conv channels). ``mesh.rules`` maps logical names to mesh axes
(default ``embed → fsdp``, ``hidden → tensor``, ``vocab → tensor``: FSDP over the model width, tensor
parallelism over the inner widths). A dimension that a mesh axis does not divide, or a second dimension
asking for an axis already used by the tensor, stays replicated. Vectors (norm scales, biases, gains) are
replicated. So no layer needs sharding annotations, and a new mixer is sharded like the rest.
"""
from __future__ import annotations

import logging
import math

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from mixerlab.models.sharding import BATCH_AXES  # the input batch and the activations share these axes

log = logging.getLogger(__name__)

AXES = ("data", "fsdp", "tensor")


def mesh_shape(cfg, num_devices: int, num_slices: int = 1) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """(ICI shape, DCN shape) over (data, fsdp, tensor); resolves the one -1 entry."""
    m = cfg.mesh
    dcn = (m.dcn_data, m.dcn_fsdp, 1)
    if math.prod(dcn) != num_slices:
        raise ValueError(f"mesh.dcn_data × mesh.dcn_fsdp = {math.prod(dcn)} must equal the number of slices "
                         f"({num_slices})")
    per_slice = num_devices // num_slices
    ici = [m.data, m.fsdp, m.tensor]
    fill = [i for i, n in enumerate(ici) if n == -1]
    if len(fill) > 1:
        raise ValueError("mesh: at most one of mesh.data, mesh.fsdp, mesh.tensor may be -1")
    known = math.prod(n for n in ici if n != -1)
    if fill:
        if per_slice % known:
            raise ValueError(f"mesh: {per_slice} devices per slice are not divisible by the fixed mesh axes "
                             f"(product {known}: data={m.data}, fsdp={m.fsdp}, tensor={m.tensor})")
        ici[fill[0]] = per_slice // known
    if math.prod(ici) != per_slice:
        raise ValueError(f"mesh: data×fsdp×tensor = {ici[0]}×{ici[1]}×{ici[2]} = {math.prod(ici)} does not match "
                         f"the {per_slice} devices per slice; set one axis to -1 to fill")
    return tuple(ici), dcn


def make_mesh(cfg, devices=None) -> Mesh:
    devices = list(jax.devices() if devices is None else devices)
    slices = sorted({getattr(d, "slice_index", 0) for d in devices})
    ici, dcn = mesh_shape(cfg, len(devices), len(slices))
    if len(slices) > 1:
        from jax.experimental import mesh_utils

        grid = mesh_utils.create_hybrid_device_mesh(ici, dcn, devices)
    else:
        try:
            from jax.experimental import mesh_utils

            grid = mesh_utils.create_device_mesh(ici, devices)
        except (ValueError, NotImplementedError, AssertionError):  # CPU or unusual topologies: plain order
            grid = np.array(devices).reshape(ici)
    return Mesh(grid, AXES)


def logical_axes(shape: tuple[int, ...], d_model: int, vocab_size: int) -> tuple[str | None, ...]:
    if len(shape) < 2:
        return (None,) * len(shape)
    return tuple("vocab" if n == vocab_size else "embed" if n == d_model else "hidden" for n in shape)


def param_spec(shape, names, mesh: Mesh, rules: dict) -> P:
    used, spec = set(), []
    for n, name in zip(shape, names):
        axis = rules.get(name) if name else None
        if axis is None or axis in used or mesh.shape[axis] == 1 or n % mesh.shape[axis]:
            spec.append(None)
        else:
            spec.append(axis)
            used.add(axis)
    return P(*spec)


def rules_of(cfg) -> dict:
    r = cfg.mesh.rules
    return {"embed": r.embed, "hidden": r.hidden, "vocab": r.vocab}


def param_shardings(abstract_params, mesh: Mesh, cfg, vocab_size: int):
    """NamedSharding per parameter (a pytree like ``abstract_params``, leaves with .shape)."""
    rules = rules_of(cfg)
    return jax.tree.map(
        lambda x: NamedSharding(mesh, param_spec(x.shape, logical_axes(x.shape, cfg.model.d_model, vocab_size),
                                                 mesh, rules)), abstract_params)


def batch_sharding(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P(BATCH_AXES))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def follow_param_shardings(state, params, param_shardings, default):
    """Shardings for an optimizer state: a leaf whose key path ends with a parameter's key path (Adam's
    mu/nu, ...) and has its shape takes that parameter's sharding; everything else gets ``default``."""
    flat_params = jax.tree_util.tree_flatten_with_path(params)[0]
    by_path = {tuple(path): (x.shape, sh) for (path, x), sh in zip(flat_params, jax.tree.leaves(param_shardings))}
    longest = max((len(p) for p in by_path), default=0)

    def pick(path, leaf):
        path = tuple(path)
        for n in range(min(longest, len(path)), 0, -1):
            hit = by_path.get(path[-n:])
            if hit is not None and tuple(hit[0]) == tuple(getattr(leaf, "shape", ())):
                return hit[1]
        return default

    return jax.tree_util.tree_map_with_path(pick, state)
