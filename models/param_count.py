"""Parameter accounting: every parameter, and the Muir/GDN-2 papers' "matrices only" convention (Muir, Table 11).

``count_params(model) -> dict`` works on a concrete model or on an abstract one (``nnx.eval_shape``, e.g.
``models.decoder.abstract_model``), so paper-scale models are counted without allocating them.

The "matrices only" rule, applied to every ``nnx.Param`` leaf (explicit, by type and rank, never by name):
  COUNTED   a parameter of rank >= 2 that is an ordinary ``nnx.Param``: embeddings, output head, every
            projection matrix (q, k, v, o; low-rank gate factors W_down/W_up; dense gates such as GDN-2's
            W_b, W_w; Muir's fused down-projection), FFN matrices;
  COUNTED   ``mixers.gates.ReadoutGain`` (Muir's gamma^stat, d entries per layer): the Muir paper's Table 11 adds
            exactly d per layer for static gamma although it is a vector;
  EXCLUDED  ``mixers.base.DynamicsParam`` and subclasses (A_log, dt_bias, gate biases c_m, SSM parameters),
            ``mixers.short_conv.ShortConvKernel`` (short-conv kernels, although 2-D), and every rank-0/1
            parameter (biases, norm scales omega / RMSNorm).
With these rules every count of the Muir paper we can check (Table 11 at 166M, Table 18 at 406M) is reproduced
exactly, and the other scales follow from the same rules (tests/models/test_param_count.py).

Returned keys:
  ``all``        every ``nnx.Param`` element;
  ``matrices``   the "matrices only" count;
  ``matrices_by_group`` / ``all_by_group``: the same split by where a parameter lives: for a decoder
                 ``blocks.<i>.<name>`` is grouped as ``<name>`` ("mixer", "ffn", "mixer_norm", ...) and
                 top-level modules by their attribute name ("embed", "lm_head", "final_norm").
"""
from __future__ import annotations

import math

from flax import nnx

from mixerlab.mixers.base import DynamicsParam
from mixerlab.mixers.gates import ReadoutGain
from mixerlab.mixers.short_conv import ShortConvKernel


def is_matrix_param(var) -> bool:
    """The "matrices only" rule (module docstring) for one ``nnx.Variable``."""
    if isinstance(var, ReadoutGain):
        return True
    if isinstance(var, (DynamicsParam, ShortConvKernel)) or not isinstance(var, nnx.Param):
        return False
    return len(_shape(var)) >= 2


def _shape(var) -> tuple[int, ...]:
    return tuple(var.get_value().shape)


def _group(path) -> str:
    keys = [str(getattr(p, "key", p)) for p in path]
    if len(keys) >= 3 and keys[0] in ("blocks", "layers") and keys[1].isdigit():
        return keys[2]
    return keys[0]


def count_params(model) -> dict:
    total = matrices = 0
    all_by_group: dict[str, int] = {}
    matrices_by_group: dict[str, int] = {}
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        n = math.prod(_shape(var))
        group = _group(path)
        total += n
        all_by_group[group] = all_by_group.get(group, 0) + n
        if is_matrix_param(var):
            matrices += n
            matrices_by_group[group] = matrices_by_group.get(group, 0) + n
    return {"all": total, "matrices": matrices, "all_by_group": all_by_group,
            "matrices_by_group": matrices_by_group}


def format_millions(n: int) -> str:
    return f"{n / 1e6:.2f}M"
