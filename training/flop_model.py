"""Analytic training FLOPs and model FLOP utilisation (MFU); the convention with a worked example: docs/flops.md.

FLOPs are forward + backward (3 × forward for matmuls; 2 FLOPs per multiply-add):
  * every parameter matrix except the input embedding table: 6 · (its size) per token (the lookup is free; the
    output head, tied or not, is a V × d matmul);
  * recurrent mixers (the delta family), per token: the chunked algorithm's MXU FLOPs, forward + backward, per
    token per head, × H, from pallas_kernels/delta_rule/flops.py (chunk = the mixer's chunk_size or 64, leaf 8).
    Fixed by the architecture and the config, not by the kernel that runs, so a faster kernel shows a higher MFU.
    Linear attention, Mamba-2, RetNet, GLA and HGRN2 run the same op without an erase key and are counted with the
    no-erase kernel's stages (no A, no inverse, no solve);
    RWKV-7 (the DPLR op) from pallas_kernels/dplr_delta_rule/flops.py (chunk = its chunk_size or 64);
  * softmax attention, per causal query-key pair *inside a document*: forward QKᵀ 2·d_k and PV 2·d_v per pair
    and head, × 3 for forward + backward, i.e. 6·H·(d_k + d_v) per pair and layer. A row whose documents have
    lengths L1..Ln holds Σ Li(Li+1)/2 pairs (the packed-document kernels skip the pairs across documents), so the
    attention FLOPs of a step come from its batch (:func:`causal_pairs` of the segment ids) and not from T;
  * other mixers: not modelled yet (0), reported in ``notes``.
MFU = model FLOPs per step / (step time × chips × the chip's datasheet dense bf16 peak, pallas_kernels/chips.py),
whatever the run's dtype; above 100 % is impossible and refused (:class:`ImpossibleMFU`).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from mixerlab.pallas_kernels import chips
from mixerlab.pallas_kernels.delta_rule import flops as kernel_flops
from mixerlab.pallas_kernels.dplr_delta_rule import flops as dplr_flops

DELTA_FAMILY = {"deltanet", "gated_deltanet", "kda", "gdn2", "muir"}
# mixers on the delta-rule op without an erase key (erase_key=None): the no-erase kernel's stages
NO_ERASE = {"linear_attention", "mamba2", "retnet", "gla", "hgrn2"}
ATTENTION = {"softmax"}
DPLR_FAMILY = {"rwkv7"}  # the diagonal-plus-low-rank op (pallas_kernels/dplr_delta_rule/flops.py)


@dataclasses.dataclass(frozen=True)
class FlopCount:
    per_token: float  # training FLOPs per token (fwd + bwd), softmax attention's query-key work excluded
    matmul_per_token: float
    core_per_token: float  # the recurrent mixers' cores
    per_attention_pair: float  # training FLOPs per causal query-key pair of a document, summed over the layers
    notes: tuple[str, ...]

    def step_flops(self, tokens: float, attention_pairs: float) -> float:
        """Model FLOPs of a step of ``tokens`` tokens whose documents hold ``attention_pairs`` causal pairs."""
        return self.per_token * tokens + self.per_attention_pair * attention_pairs


def _pow2_floor(n: int) -> int:
    return 1 << (max(1, n).bit_length() - 1)


def core_flops_per_token(cfg, mixer: str, seq_len: int) -> tuple[float, str | None]:
    """A recurrent mixer's core FLOPs per token (0 for softmax attention, which is counted per pair)."""
    h, dk, dv = cfg.model.num_heads, cfg.head_dim, cfg.value_head_dim
    if mixer in ATTENTION:
        return 0.0, None
    if mixer in DELTA_FAMILY or mixer in NO_ERASE:
        chunk = getattr(cfg.mixer_options(mixer), "chunk_size", 0) or 64
        chunk = _pow2_floor(min(chunk, max(seq_len, 2)))
        leaf = min(8, chunk) if chunk >= 2 else 2
        kc = kernel_flops.KernelConfig(chunk=max(chunk, 2), leaf=max(leaf, 2), d_k=dk, d_v=dv,
                                       has_erase=mixer not in NO_ERASE)
        fwd = kernel_flops.total(kernel_flops.forward_stages(kc)).mxu
        bwd = kernel_flops.total(kernel_flops.backward_stages(kc)).mxu
        return float(h * (fwd + bwd)), None
    if mixer in DPLR_FAMILY:
        chunk = min(getattr(cfg.mixer_options(mixer), "chunk_size", 0) or 64, max(seq_len, 1))
        return h * dplr_flops.training_flops_per_token(chunk, dk, dv), None
    return 0.0, f"{mixer}: core FLOPs not modelled (counted as 0)"


def attention_flops_per_pair(cfg, mixer: str) -> float:
    """Training FLOPs of one causal query-key pair in one layer: 3 × (QKᵀ 2·d_k + PV 2·d_v) × H."""
    if mixer not in ATTENTION:
        return 0.0
    return 6.0 * cfg.model.num_heads * (cfg.head_dim + cfg.value_head_dim)


def training_flops(cfg, abstract_params, vocab_size: int) -> FlopCount:
    """The config's FLOP count (``abstract_params``: the parameter pytree, any leaves with .shape)."""
    matmul = 0
    for path, leaf in jax.tree_util.tree_flatten_with_path(abstract_params)[0]:
        keys = [str(getattr(p, "key", getattr(p, "idx", p))) for p in path]
        if len(leaf.shape) < 2:
            continue
        if keys and keys[0] == "embed" and not cfg.model.tie_embeddings:
            continue
        matmul += int(np.prod(leaf.shape))
    notes, core, per_pair = [], 0.0, 0.0
    for mixer in cfg.layer_mixers:
        c, note = core_flops_per_token(cfg, mixer, cfg.data.seq_len)
        core += c
        per_pair += attention_flops_per_pair(cfg, mixer)
        if note and note not in notes:
            notes.append(note)
    return FlopCount(per_token=6.0 * matmul + core, matmul_per_token=6.0 * matmul, core_per_token=core,
                     per_attention_pair=per_pair, notes=tuple(notes))


# ------------------------------------------------------------------------------------------ attention pairs
def causal_pairs(segment_ids) -> jax.Array:
    """Σ over the documents of every row of L(L+1)/2: the causal query-key pairs within documents (float32
    scalar; a jittable reduction, no host sync). A document starts at a row's first token and wherever the
    id changes (so ids need not increase); tokens with id 0 (padding) attend to nothing."""
    seg = jnp.asarray(segment_ids)
    idx = jnp.arange(seg.shape[-1], dtype=jnp.int32)
    start = jnp.concatenate([jnp.ones(seg.shape[:-1] + (1,), bool), seg[..., 1:] != seg[..., :-1]], axis=-1)
    first = jax.lax.cummax(jnp.where(start, idx, 0), axis=seg.ndim - 1)  # where each token's document starts
    keys = (idx - first + 1).astype(jnp.float32)  # keys a query attends to: its document's tokens so far
    return jnp.sum(jnp.where(seg != 0, keys, 0.0))


def full_row_pairs(rows: int, seq_len: int) -> float:
    """The pairs of ``rows`` rows that are each one document (documents at least as long as the context): the
    most a step can hold, and what ``--compile_only`` assumes without data."""
    return rows * seq_len * (seq_len + 1) / 2


# ------------------------------------------------------------------------------------------------------ MFU
class ImpossibleMFU(RuntimeError):
    """Model FLOPs per second above the chips' peak: a FLOP count or a timing is wrong."""


def device_chip(device=None) -> chips.Chip | None:
    """The chip of a JAX device (default: the first) from its device_kind; None for CPUs and unknown chips."""
    device = device or jax.devices()[0]
    return chips.by_device_kind(getattr(device, "device_kind", ""))


def utilisation(step_flops: float, step_seconds: float, num_chips: int, chip: chips.Chip | None,
                what: str) -> dict:
    """``model_tflops_per_s``, and where the chip is known ``mfu`` (datasheet dense bf16 peak) and
    ``mfu_measured_peak`` (the project's measured matmul rate, where there is one). Raises ImpossibleMFU, naming
    ``what`` (the configuration) and the FLOP count, when the datasheet MFU is above 100 %."""
    rate = step_flops / max(step_seconds, 1e-12)
    out = {"model_tflops_per_s": rate / 1e12}
    if chip is None:
        return out
    mfu = rate / (num_chips * chip.bf16_peak)
    if mfu > 1.0:
        raise ImpossibleMFU(
            f"{what}: MFU {100 * mfu:.1f} % is above 100 % ({step_flops:.4e} model FLOPs per step in "
            f"{step_seconds * 1e3:.2f} ms on {num_chips} × {chip.name} at {chip.bf16_peak / 1e12:.0f} TFLOP/s dense "
            f"bf16); the FLOP count (training/flop_model.py) or the timing is wrong, so no MFU is reported")
    out["mfu"] = mfu
    if chip.measured_bf16:
        out["mfu_measured_peak"] = rate / (num_chips * chip.measured_bf16)
    return out


def peak_description(chip: chips.Chip | None, dtype: str) -> str:
    """How the MFU of a run is quoted, for start-up lines and tables."""
    if chip is None:
        return "no MFU (no known peak for this device)"
    text = f"MFU against the {chip.name} dense bf16 datasheet peak, {chip.bf16_peak / 1e12:.0f} TFLOP/s per chip"
    if chip.measured_bf16:
        text += f" (and the measured {chip.measured_bf16 / 1e12:.0f})"
    if dtype != "bfloat16":
        text += f"; this run computes in {dtype}"
    return text
