"""The gate projections of Muir and GDN-2 layers as (down, up) factor pairs, and their SVD rank truncation.

Muir (``mixers/muir.py``): one fused down-projection W↓ [d, R_tot] whose column blocks (r_f, r_b, r_g, r_w, r_q)
feed the up-projections W_m↑ [r_m, H·D]; gate m's pre-activation is x W↓[:, m] W_m↑ + c_m. GDN-2
(``mixers/gdn2.py``): low-rank f and g (``LowRank``: down, up) and dense b and w (W [d, H·D], treated as
down = W, up = I). There is no nonlinearity between the factors, so the gate's effective matrix is the product
E_m = down · up [d, H·D] [Muir, Table 19; docs/math/delta_rule.md].

Truncation to rank r (Muir Table 19): E_m = U Σ Vᵀ (float64 SVD), keep the r largest singular values:
down ← U_r Σ_r, up ← V_rᵀ, zero-padded back to the layer's rank r_m (shapes unchanged); a dense gate gets
W ← U_r Σ_r V_rᵀ. The additive bias c_m is kept; r = 0 leaves the bias alone. At r ≥ rank(E_m) the product is
E_m up to float32 rounding of the new factors.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import jax.numpy as jnp
import numpy as np

from mixerlab.eval.diagnostics.gate_hooks import delta_layers


@dataclasses.dataclass
class GateFactor:
    """One gate projection of one layer: ``get() -> (down [d, r], up [r, n])`` and ``set(down, up)``."""

    name: str
    rank: int  # r_m: the factors' inner dimension (d for a dense gate)
    get: Callable[[], tuple[np.ndarray, np.ndarray]]
    set: Callable[[np.ndarray, np.ndarray], None]

    def effective(self) -> np.ndarray:
        down, up = self.get()
        return down @ up


def _kernel(linear) -> np.ndarray:
    return np.asarray(linear.kernel[...], np.float64)


def _assign(linear, value) -> None:
    linear.kernel[...] = jnp.asarray(value, linear.kernel[...].dtype)


def _muir_factors(mixer) -> dict[str, GateFactor]:
    ranks = dict(zip("fbgwq", mixer.ranks))
    offsets = dict(zip("fbgwq", np.cumsum((0,) + tuple(mixer.ranks[:-1]))))
    ups = {"f": "f_up", "b": "b_up", "g": "g_up", "w": "w_up", "q": "q_up"}
    out = {}
    for name, r in ranks.items():
        if r == 0:
            continue
        cols = slice(int(offsets[name]), int(offsets[name]) + r)
        up_layer = getattr(mixer, ups[name])

        def get(_cols=cols, _up=up_layer):
            return _kernel(mixer.gate_down)[:, _cols], _kernel(_up)

        def set_(down, up, _cols=cols, _up=up_layer):
            full = np.asarray(mixer.gate_down.kernel[...], np.float64).copy()
            full[:, _cols] = down
            _assign(mixer.gate_down, full)
            _assign(_up, up)

        out[name] = GateFactor(name, r, get, set_)
    return out


def _gdn2_factors(mixer) -> dict[str, GateFactor]:
    out = {}
    for name, attr in (("f", "f_proj"), ("g", "g_proj")):
        low = getattr(mixer, attr)
        out[name] = GateFactor(
            name, int(low.down.kernel[...].shape[1]),
            lambda _low=low: (_kernel(_low.down), _kernel(_low.up)),
            lambda down, up, _low=low: (_assign(_low.down, down), _assign(_low.up, up)))
    for name, attr in (("b", "b_proj"), ("w", "w_proj")):
        dense = getattr(mixer, attr)
        d_in = int(dense.kernel[...].shape[0])
        out[name] = GateFactor(
            name, d_in, lambda _dense=dense: (_kernel(_dense), np.eye(_dense.kernel[...].shape[1])),
            lambda down, up, _dense=dense: _assign(_dense, down @ up))
    return out


def gate_factors(mixer) -> dict[str, GateFactor]:
    """The gate projections of a Muir or GDN-2 layer, by gate name (f, b, g, w[, q])."""
    from mixerlab.mixers.gdn2 import GDN2
    from mixerlab.mixers.muir import Muir

    if isinstance(mixer, Muir):
        return _muir_factors(mixer)
    if isinstance(mixer, GDN2):
        return _gdn2_factors(mixer)
    raise TypeError(f"gate_factors: no low-rank gate projections known for {type(mixer).__name__} "
                    f"(supported: Muir, GDN2)")


def truncated_factors(effective: np.ndarray, rank: int, width: int) -> tuple[np.ndarray, np.ndarray]:
    """Best rank-``rank`` factors (U_r Σ_r [d, width], V_rᵀ [width, n]) of ``effective``, zero-padded to
    ``width`` (≥ rank) columns / rows."""
    if rank < 0 or rank > width:
        raise ValueError(f"truncated_factors: rank={rank} must be in [0, {width}]")
    u, s, vt = np.linalg.svd(np.asarray(effective, np.float64), full_matrices=False)
    keep = min(rank, len(s))
    down = np.zeros((effective.shape[0], width))
    up = np.zeros((width, effective.shape[1]))
    down[:, :keep] = u[:, :keep] * s[:keep]
    up[:keep] = vt[:keep]
    return down, up


def truncate_gate(model, gate: str, rank: int) -> None:
    """In place: gate ``gate`` of every Muir/GDN-2 layer of ``model`` → its best rank-``rank`` approximation
    (``rank`` is capped at each layer's r_m)."""
    found = False
    for _, mixer in delta_layers(model):
        factors = gate_factors(mixer)
        if gate not in factors:
            continue
        found = True
        factor = factors[gate]
        factor.set(*truncated_factors(factor.effective(), min(rank, factor.rank), factor.rank))
    if not found:
        raise ValueError(f"truncate_gate: no layer of the model has a gate {gate!r} with a projection")


def gate_names(model) -> list[str]:
    """Gates with a projection in at least one layer, in Muir's order f, b, g, w, q."""
    present = set()
    for _, mixer in delta_layers(model):
        present |= set(gate_factors(mixer))
    return [name for name in "fbgwq" if name in present]


def max_rank(model, gate: str) -> int:
    return max(gate_factors(m)[gate].rank for _, m in delta_layers(model) if gate in gate_factors(m))
