"""Observe or replace the gates of the delta-rule layers of a decoder during a forward pass.

Every delta-rule layer (``mixers.delta_common.DeltaMixer``: DeltaNet, Gated DeltaNet, KDA, GDN-2, Muir) computes
its gates in the subclass hook ``_gates(x) -> Gates`` and its op inputs in ``_core_inputs(q, k, v, gates) ->
(q̂, k̂, v̂)``, with q, k the L2-normalised query and key. ``gate_hooks`` shadows these two methods on the layer
*instances* (not the classes) for the duration of a ``with`` block:

* ``on_gates(layer, gates) -> gates``: sees every layer's ``Gates`` and returns the ones the layer uses
  (the same object to observe, a ``gates._replace(...)`` to intervene);
* ``on_core(layer, k, k_hat)``: sees the key and the erase key ``k̂ = b ⊙ k`` fed to the op.

``layer`` is the index of the block in ``model.blocks``. Inside ``jax.jit`` the callbacks see tracers; whatever
they store must be returned from the traced function. Nothing is changed after the block exits.

Gate names used by the diagnostics follow Muir Fig. 3b: f = log α_t (``Gates.log_decay``), b = erase,
g = output gate (pre-activation), w = write, q = readout gain γ_t (``Gates.q_gain``).
"""
from __future__ import annotations

import contextlib
from typing import Callable, Optional

from mixerlab.mixers.delta_common import DeltaMixer

GATE_FIELDS = {"f": "log_decay", "b": "erase", "g": "out_gate", "w": "write", "q": "q_gain"}


def delta_layers(model) -> list[tuple[int, DeltaMixer]]:
    """(block index, mixer) of every delta-rule layer of a ``models.decoder.Decoder``."""
    blocks = getattr(model, "blocks", None)
    if blocks is None:
        raise TypeError(f"gate_hooks: expected a models.decoder.Decoder (with .blocks), got {type(model).__name__}")
    return [(i, block.mixer) for i, block in enumerate(blocks) if isinstance(block.mixer, DeltaMixer)]


@contextlib.contextmanager
def gate_hooks(model, on_gates: Optional[Callable] = None, on_core: Optional[Callable] = None):
    layers = delta_layers(model)
    if not layers:
        raise ValueError("gate_hooks: the model has no delta-rule layer (DeltaMixer) to hook")
    installed = []
    try:
        for index, mixer in layers:
            if on_gates is not None:
                original_gates = mixer._gates

                def gates(x, _index=index, _original=original_gates):
                    return on_gates(_index, _original(x))

                setattr(mixer, "_gates", gates)
                installed.append((mixer, "_gates"))
            if on_core is not None:
                original_core = mixer._core_inputs

                def core_inputs(q, k, v, g, _index=index, _original=original_core):
                    q_hat, k_hat, v_hat = _original(q, k, v, g)
                    on_core(_index, k, k if k_hat is None else k_hat)
                    return q_hat, k_hat, v_hat

                setattr(mixer, "_core_inputs", core_inputs)
                installed.append((mixer, "_core_inputs"))
        yield layers
    finally:
        for mixer, name in installed:
            delattr(mixer, name)
