"""Validation NLL of a decoder with its delta-rule gates observed and, optionally, frozen (``gate_hooks``).

``GateEvaluator(model)`` splits the model once (nnx graph + state) and jits ONE forward that serves every
diagnostic (a compile costs ~30 s on a small CPU model): ``evaluate(batches, state=None, frozen=None)`` returns

* per-row summed NLL and token counts (``models.decoder.cross_entropy`` with the batch's ``loss_mask``), for the
  model's own state or another state of the same graph (e.g. truncated gate factors);
* per layer, the mean of every gate over the valid tokens (segment_ids > 0: every real token, padding
  excluded), per head and channel;
* per layer, the erase rate μ_t = ⟨k_t, b_t ⊙ k_t⟩ per valid token and head.

``frozen = (gate_mean, fields)`` replaces, in every layer, each gate field in ``fields`` by the constant
``gate_mean[layer][field]`` at every token (the blend g + s·(ḡ − g) with s ∈ {0, 1}, so one compiled function
serves every choice of fields; s = 0 leaves g bitwise unchanged).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mixerlab.eval.diagnostics.gate_hooks import delta_layers, gate_hooks
from mixerlab.models.decoder import cross_entropy

BATCH_KEYS = ("inputs", "targets", "segment_ids", "positions", "loss_mask")


def _channels(shape) -> tuple[int, int]:
    """[B, T, H, D] / [1, 1, H, D] -> (H, D); per-head [B, T, H] -> (H, 1)."""
    return (shape[2], 1) if len(shape) == 3 else (shape[-2], shape[-1])


def gate_template(model) -> dict:
    """{layer: {field: zeros [H, D]}} for every gate field each delta-rule layer produces (by abstract
    evaluation of the layer's ``_gates`` on one token: nothing is computed)."""
    template = {}
    for layer, mixer in delta_layers(model):
        x = jax.ShapeDtypeStruct((1, 1, mixer.spec.d_model), jnp.float32)
        gates = jax.eval_shape(mixer._gates, x)
        template[layer] = {f: jnp.zeros(_channels(g.shape), jnp.float32)
                           for f, g in zip(gates._fields, gates) if g is not None}
    return template


def _row_nll(logits, batch):
    """Summed NLL and token count per row [B]."""
    mean, count = jax.vmap(lambda l, t, m: cross_entropy(l[None], t[None], m[None]))(
        logits, batch["targets"], batch["loss_mask"])
    return mean * count, count


def _masked_channel_sum(x, mask_BT):
    """Σ over valid tokens of a gate [B, T, H, D], [B, T, H] or token-independent [1, 1, H, D] -> [H, D]."""
    if x.ndim == 3:
        x = x[..., None]
    x = jnp.broadcast_to(x, mask_BT.shape + x.shape[-2:])
    return jnp.einsum("bthd,bt->hd", x.astype(jnp.float32), mask_BT)


def _forward(graphdef, state, batch, means, select):
    model = nnx.merge(graphdef, state)
    mask = (batch["segment_ids"] > 0).astype(jnp.float32)
    captured = {}

    def on_gates(layer, gates):
        captured[layer] = {"gate_sum": {f: _masked_channel_sum(getattr(gates, f), mask) for f in means[layer]}}
        fixed = {}
        for f, mean in means[layer].items():
            g = getattr(gates, f)
            shape = batch["inputs"].shape + g.shape[2:]  # the layer's own [B, T, H(, D)]
            g = jnp.broadcast_to(g, shape)
            fixed[f] = g + select[f] * (jnp.reshape(mean, shape[2:]).astype(g.dtype) - g)
        return gates._replace(**fixed)

    def on_core(layer, k, k_hat):
        captured[layer]["erase_rate"] = jnp.sum(k.astype(jnp.float32) * k_hat.astype(jnp.float32), axis=-1)

    with gate_hooks(model, on_gates, on_core):
        logits = model(batch["inputs"], segment_ids=batch["segment_ids"], positions=batch["positions"])
    total, count = _row_nll(logits, batch)
    return total, count, captured, jnp.sum(mask)


class GateEvaluator:
    def __init__(self, model):
        self.graphdef, self.state = nnx.split(model)
        self.template = gate_template(model)
        self.fields = sorted({f for fields in self.template.values() for f in fields})
        self._run = jax.jit(functools.partial(_forward, self.graphdef))

    @staticmethod
    def _batch(batch) -> dict:
        missing = [k for k in BATCH_KEYS if k not in batch]
        if missing:
            raise KeyError(f"GateEvaluator: batch lacks {missing}; expected keys {BATCH_KEYS} "
                           f"(training.data.eval_batches)")
        return {k: jnp.asarray(batch[k]) for k in BATCH_KEYS}

    def evaluate(self, batches, state=None, frozen=None) -> dict:
        """NLL rows {"row_sum", "row_count"} [N rows], "gate_mean" {layer: {field: [H, D]}}, "erase_rate"
        {layer: [valid tokens, H]} and "tokens" (valid tokens), all numpy."""
        state = self.state if state is None else state
        means, fields = frozen if frozen is not None else (self.template, ())
        unknown = set(fields) - set(self.fields)
        if unknown:
            raise ValueError(f"GateEvaluator: cannot freeze {sorted(unknown)}; the layers' gate fields are "
                             f"{self.fields}")
        means = {layer: {f: jnp.asarray(means.get(layer, {}).get(f, zero), jnp.float32) for f, zero in t.items()}
                 for layer, t in self.template.items()}
        select = {f: jnp.float32(f in fields) for f in self.fields}
        sums, counts, gate_sums, erase, tokens = [], [], {}, {}, 0.0
        for batch in batches:
            b = self._batch(batch)
            s, c, captured, n = self._run(state, b, means, select)
            sums.append(np.asarray(s, np.float64))
            counts.append(np.asarray(c, np.float64))
            tokens += float(n)
            valid = np.asarray(b["segment_ids"]) > 0
            for layer, rec in captured.items():
                acc = gate_sums.setdefault(layer, {})
                for field, x in rec["gate_sum"].items():
                    acc[field] = acc.get(field, 0.0) + np.asarray(x, np.float64)
                erase.setdefault(layer, []).append(np.asarray(rec["erase_rate"], np.float64)[valid])
        gate_mean = {layer: {f: x / max(tokens, 1.0) for f, x in acc.items()} for layer, acc in gate_sums.items()}
        return {"row_sum": np.concatenate(sums), "row_count": np.concatenate(counts), "gate_mean": gate_mean,
                "erase_rate": {layer: np.concatenate(x) for layer, x in erase.items()}, "tokens": tokens}


def mean_nll(rows: dict) -> float:
    return float(rows["row_sum"].sum() / max(rows["row_count"].sum(), 1.0))


def delta_nll(base: dict, other: dict) -> tuple[float, float]:
    """Token-weighted ΔNLL = NLL(other) − NLL(base) and its paired standard error over rows (rows with
    tokens; per-row token means)."""
    delta = mean_nll(other) - mean_nll(base)
    has = base["row_count"] > 0
    per_row = (other["row_sum"][has] - base["row_sum"][has]) / base["row_count"][has]
    se = float(per_row.std(ddof=1) / np.sqrt(len(per_row))) if len(per_row) > 1 else float("nan")
    return delta, se
