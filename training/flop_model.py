"""Analytic training FLOPs per token and model FLOP utilisation (MFU).

Convention (counted per token, forward + backward = 3 × forward for matmuls):
  * every parameter matrix except the input embedding table: 6 · (its size)
    (the lookup is free; the output head, tied or not, is a V × d matmul);
  * the token-mixing core of each layer, which has no parameters:
      softmax attention  6 · T · H · D_h          (causal: QKᵀ and AV each 2·H·D_h·T/2 forward)
      delta family       the chunkwise kernel's MXU FLOPs, forward + backward, per token per head, × H,
                         from pallas_kernels/delta_rule/flops.py (chunk = the mixer's chunk_size or 64, leaf 8);
                         linear attention is counted the same way (an upper bound: its T and Y vanish)
      other mixers       not modelled yet (0), reported in ``notes``.
MFU = model FLOPs per step / (step time × chips × peak bf16 FLOP/s of the chip).
"""
from __future__ import annotations

import dataclasses

import jax
import numpy as np

from mixerlab.pallas_kernels.delta_rule import flops as kernel_flops

DELTA_FAMILY = {"linear_attention", "deltanet", "gated_deltanet", "kda", "gdn2", "muir"}

# device_kind substrings -> peak name in pallas_kernels.delta_rule.flops.PEAKS
_KIND_TO_PEAK = (("v6", "v6e"), ("v5 lite", "v5e"), ("v5e", "v5e"), ("v5p", "v5p"), ("v5", "v5p"), ("v4", "v4"),
                 ("H200", "H200"))


@dataclasses.dataclass(frozen=True)
class FlopCount:
    per_token: float  # training FLOPs per token (fwd + bwd)
    matmul_per_token: float
    core_per_token: float
    notes: tuple[str, ...]


def _pow2_floor(n: int) -> int:
    return 1 << (max(1, n).bit_length() - 1)


def core_flops_per_token(cfg, mixer: str, seq_len: int) -> tuple[float, str | None]:
    h, dk, dv = cfg.model.num_heads, cfg.head_dim, cfg.value_head_dim
    if mixer == "softmax":
        return 6.0 * seq_len * h * dk, None
    if mixer in DELTA_FAMILY:
        chunk = getattr(cfg.mixer_options(mixer), "chunk_size", 0) or 64
        chunk = _pow2_floor(min(chunk, max(seq_len, 2)))
        leaf = min(8, chunk) if chunk >= 2 else 2
        kc = kernel_flops.KernelConfig(chunk=max(chunk, 2), leaf=max(leaf, 2), d_k=dk, d_v=dv)
        fwd = kernel_flops.total(kernel_flops.forward_stages(kc)).mxu
        bwd = kernel_flops.total(kernel_flops.backward_stages(kc)).mxu
        return float(h * (fwd + bwd)), None
    return 0.0, f"{mixer}: core FLOPs not modelled (counted as 0)"


def training_flops(cfg, abstract_params, vocab_size: int) -> FlopCount:
    """FLOPs per trained token for the config (``abstract_params``: the parameter pytree, any leaves with .shape)."""
    matmul = 0
    for path, leaf in jax.tree_util.tree_flatten_with_path(abstract_params)[0]:
        keys = [str(getattr(p, "key", getattr(p, "idx", p))) for p in path]
        if len(leaf.shape) < 2:
            continue
        if keys and keys[0] == "embed" and not cfg.model.tie_embeddings:
            continue
        matmul += int(np.prod(leaf.shape))
    notes, core = [], 0.0
    for mixer in cfg.layer_mixers:
        c, note = core_flops_per_token(cfg, mixer, cfg.data.seq_len)
        core += c
        if note and note not in notes:
            notes.append(note)
    return FlopCount(per_token=6.0 * matmul + core, matmul_per_token=6.0 * matmul, core_per_token=core,
                     notes=tuple(notes))


def peak_flops(device=None) -> tuple[str, float] | None:
    """(chip name, peak bf16 FLOP/s) for a TPU/GPU device we know; None for CPUs and unknown chips."""
    device = device or jax.devices()[0]
    kind = getattr(device, "device_kind", "")
    for key, name in _KIND_TO_PEAK:
        if key.lower() in kind.lower():
            return name, kernel_flops.PEAKS[name].flops
    return None


def mfu(flops_per_step: float, step_seconds: float, num_chips: int, peak: float) -> float:
    return flops_per_step / max(step_seconds, 1e-12) / (num_chips * peak)
