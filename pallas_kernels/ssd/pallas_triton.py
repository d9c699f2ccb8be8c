"""Grouped scalar-decay linear attention (Mamba-2's SSD) on GPU through Pallas' Triton backend: one forward kernel,
a backward in two kernels, a custom VJP (docs/math/ssd.md).

Recurrence per head h of group g = h // (H/G) (row vectors, state [N, P]):

    S_t = e^{λ_t} S_{t−1} + k_tᵀ v_t,     o_t = q_t S_t          q, k [.., G, N] shared by the group's heads

Chunk of C tokens, c_i = Σ_{s≤i} λ_s (inclusive, within the chunk), L = C − 1, S₀ the state entering the chunk:

    O     = ((Q Kᵀ) ⊙ D) V + e ⊙ (Q S₀)            D_ij = e^{c_i − c_j} for j ≤ i in the same document, else 0
    S_end = γ S₀ + (K ⊙ w)ᵀ V                      e_i = e^{c_i} [i in the carried-in document]
                                                   w_j = e^{c_L − c_j} [j in the chunk's last document]
                                                   γ = e^{c_L} [no document starts in the chunk]

Every exponent is ≤ 0 (λ ≤ 0). With one decay per head these are the whole chunk algorithm: no pivot tree and
no triangular solve (the delta-rule kernels need both for per-channel decays and an erase term).

Forward, grid (H, B) (``_grid``): a program walks its head's chunks in order with S in float32 registers, writes
O, the final state and (for the backward) S₀ of every chunk. q and k are indexed by group through the BlockSpec:
the H/G heads of a group read the same rows (from L2 when they run together), and no repeated copy is made.

Split forward (``Config.split_forward``, off until it is timed): the same split for the forward. Pass 1
(``ssd_forward_states``, grid (H, B)) walks the chunks with S in registers and stores every chunk's S₀ (only
the (K ⊙ w)ᵀ V product per chunk); pass 2 (``ssd_forward_chunks``, grid (H, chunks, B)) forms every chunk's
O from its S₀. S₀ is stored in the operand dtype, the rounding the one-kernel forward gives it as a matmul
operand, so both forms give the same numbers.

Backward, two kernels. The gradient of chunk n's S_end, dS_n, is a reverse scan over the chunks; given it and
S₀, every chunk's gradients are local:

    dV  = ((Q Kᵀ) ⊙ D)ᵀ dO + w ⊙ (K dS)            G = D ⊙ (dO Vᵀ)
    dQ  = G K + e ⊙ (dO S₀ᵀ)                        dK = Gᵀ Q + w ⊙ (V dSᵀ)
    dc  = rowsum(G⊙QKᵀ) − colsum(G⊙QKᵀ) + e ⊙ rowsum(dO ⊙ Q S₀) − w ⊙ rowsum(V ⊙ K dS),
          plus Σ_j w_j rowsum(V ⊙ K dS)_j + γ ⟨S₀, dS⟩ at position L;   dλ_s = Σ_{i≥s} dc_i
    dS₀ = (e ⊙ Q)ᵀ dO + γ dS

Pass 1 (``ssd_backward_states``, grid (H, B)) walks the chunks in reverse with dS in float32 registers, stores
each chunk's dS (operand dtype, like the forward's S₀) and steps it with the last line: one product per chunk.
Pass 2 (``ssd_backward_chunks``, grid (H, chunks, B)) forms dq, dk, dv and dλ of every chunk at once from its
S₀ and dS. One program per (head, row) carrying dS through the chunks while forming the gradients (the first
version) kept dS, S₀ and a chunk's tiles live at once: ptxas spilled 656 B per thread at 8 warps and it ran
1.56× the split pair's time on an H100 (docs/math/ssd.md); the split costs one more [B, H, chunks, N, P] write
and read and gives 64× the programs.

dq and dk are written per head (the operand dtype) and summed over the group's heads by XLA afterwards.
Matmul operands in the input dtype (bf16 tensor cores for bf16 inputs), accumulation, state, decays in float32.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from mixerlab.pallas_kernels import common
from mixerlab.pallas_kernels.triton_common import (compiler_params, dot_precision, f32_matmul_precision, iota, pow2,
                                                   unavailable)

F32 = jnp.float32
SUPPORTED_CHUNKS = (16, 32, 64, 128)
DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
MIN_DIM, MAX_DIM = 16, 256  # tl.dot needs every dimension ≥ 16
MAX_STATE = 128 * 128  # N·P of the float32 state a program keeps in registers


@dataclasses.dataclass(frozen=True)
class Config:
    chunk: int
    operand_dtype: jnp.dtype  # matmul operands (bf16 or f32)
    heads_per_group: int
    precision: str = "highest"  # float32-operand matmuls: "tf32" | "highest" (make_config follows JAX's setting)
    warps_forward: int = 8  # the forward and the backward's dS scan (pass 1)
    warps_backward: int = 4  # the backward's per-chunk gradients (pass 2): 12.6 against 14.0 ms at 8 (H100)
    stages: int = 1
    split_forward: bool = False  # the forward as a state scan, then every chunk's outputs at once (module docstring)
    interpret: bool = False


def make_config(chunk, operand_dtype, heads_per_group, *, interpret=False, **overrides) -> Config:
    names = {f.name for f in dataclasses.fields(Config)} - {"chunk", "operand_dtype", "heads_per_group"}
    unknown = sorted(set(overrides) - names)
    if unknown:
        raise ValueError(f"ssd pallas_triton: unknown config field(s) {unknown}; valid: {sorted(names)}")
    cfg = Config(chunk=chunk, operand_dtype=jnp.dtype(operand_dtype), heads_per_group=heads_per_group,
                 precision=f32_matmul_precision(interpret), interpret=interpret, **overrides)
    for name in ("warps_forward", "warps_backward"):
        if not pow2(getattr(cfg, name)):
            raise ValueError(f"ssd pallas_triton: {name}={getattr(cfg, name)!r}; expected a power of two")
    return cfg


def supports(call) -> Optional[str]:
    """``None`` when these kernels can serve ``call`` (an ``api.SsdCall``), else the reason."""
    reason = unavailable(call.backend, "the Pallas-Triton SSD kernel")
    if reason:
        return reason
    if call.chunk_size not in SUPPORTED_CHUNKS:
        return f"chunk_size={call.chunk_size} not in {SUPPORTED_CHUNKS}"
    for name, d in (("state_dim", call.state_dim), ("head_dim", call.head_dim)):
        if not pow2(d) or not MIN_DIM <= d <= MAX_DIM:
            return f"{name}={d}: needs a power of two in [{MIN_DIM}, {MAX_DIM}]"
    if call.state_dim * call.head_dim > MAX_STATE:
        return f"state N·P = {call.state_dim}·{call.head_dim} > {MAX_STATE} (the float32 state stays in registers)"
    if jnp.dtype(call.dtype) not in DTYPES:
        return f"dtype {jnp.dtype(call.dtype).name} not supported (float32, bfloat16, float16)"
    return None


# ---------------------------------------------------------------------------------------------------------
# tiles


def _dot(a, b, cfg, *, trans_a=False, trans_b=False):
    """a @ b (optionally transposed) with float32 accumulation; operands in the operand dtype."""
    dims = (((0 if trans_a else 1,), (1 if trans_b else 0,)), ((), ()))
    if cfg.operand_dtype == jnp.dtype(F32):
        precision = dot_precision(cfg.precision, cfg.interpret)
        return jax.lax.dot_general(a.astype(F32), b.astype(F32), dims, precision=precision, preferred_element_type=F32)
    return jax.lax.dot_general(a.astype(cfg.operand_dtype), b.astype(cfg.operand_dtype), dims,
                               preferred_element_type=F32)


def _chunk_decays(log_decay, document, carried, c):
    """The chunk's decay factors from λ [C] (float32), the documents [C] and the carried-in document (a scalar):
    D [C, C], e [C], w [C], γ (a scalar), and the 'i ≥ j' mask for the backward's suffix sums."""
    i, j = iota((c, c), 0), iota((c, c), 1)
    lower = j <= i
    cum = jnp.sum(jnp.where(lower, log_decay[None, :], 0.0), axis=1)  # c_i, inclusive
    total = jnp.sum(log_decay)  # c_L
    last = jnp.max(document)  # documents never decrease along a row
    pairs = lower & (document[:, None] == document[None, :])
    exponent = jnp.where(pairs, cum[:, None] - cum[None, :], 0.0)
    within = jnp.where(pairs, jnp.exp(exponent), 0.0)
    start = jnp.where(document == carried, jnp.exp(cum), 0.0)
    end = jnp.where(document == last, jnp.exp(total - cum), 0.0)
    keep = jnp.where(last == carried, jnp.exp(total), 0.0)
    return within, start, end, keep, lower


def _this_chunk_decays(cfg, log_decay_ref, document_ref, carried_ref):
    """``_chunk_decays`` in a program of the (H, chunks, B) grid: its chunk's λ and documents, and the carried-in
    document of chunk ``program_id(1)``."""
    return _chunk_decays(log_decay_ref[...].astype(F32), document_ref[...], carried_ref[pl.program_id(1)], cfg.chunk)


# ---------------------------------------------------------------------------------------------------------
# kernels


def _forward_kernel(cfg, n_chunks, save_starts):
    c = cfg.chunk

    def kernel(q_ref, k_ref, v_ref, log_decay_ref, document_ref, carried_ref, s_init_ref, o_ref, s_final_ref,
               *starts_ref):
        def body(n, state):
            rows = pl.ds(n * c, c)
            q, k, v = q_ref[rows, :], k_ref[rows, :], v_ref[rows, :]
            within, start, end, keep, _ = _chunk_decays(log_decay_ref[rows].astype(F32), document_ref[rows],
                                                        carried_ref[n], c)
            scores = _dot(q, k, cfg, trans_b=True) * within
            o = _dot(scores, v, cfg) + start[:, None] * _dot(q, state, cfg)
            o_ref[rows, :] = o.astype(o_ref.dtype)
            if save_starts:
                starts_ref[0][n] = state.astype(starts_ref[0].dtype)
            return keep * state + _dot(k.astype(F32) * end[:, None], v, cfg, trans_a=True)

        s_final_ref[...] = jax.lax.fori_loop(0, n_chunks, body, s_init_ref[...].astype(F32))

    return kernel


def _state_kernel(cfg, n_chunks):
    """Split forward, pass 1: the chunks in order, storing each chunk's S₀ before stepping S to the chunk's end."""
    c = cfg.chunk

    def kernel(k_ref, v_ref, log_decay_ref, document_ref, carried_ref, s_init_ref, starts_ref, s_final_ref):
        def body(n, state):
            rows = pl.ds(n * c, c)
            _, _, end, keep, _ = _chunk_decays(log_decay_ref[rows].astype(F32), document_ref[rows], carried_ref[n], c)
            starts_ref[n] = state.astype(starts_ref.dtype)
            return keep * state + _dot(k_ref[rows, :].astype(F32) * end[:, None], v_ref[rows, :], cfg, trans_a=True)

        s_final_ref[...] = jax.lax.fori_loop(0, n_chunks, body, s_init_ref[...].astype(F32))

    return kernel


def _output_kernel(cfg):
    """Split forward, pass 2: one program per (head, chunk, row), O of the chunk from its inputs and its S₀."""

    def kernel(q_ref, k_ref, v_ref, log_decay_ref, document_ref, carried_ref, s0_ref, o_ref):
        q = q_ref[...]
        within, start, _, _, _ = _this_chunk_decays(cfg, log_decay_ref, document_ref, carried_ref)
        scores = _dot(q, k_ref[...], cfg, trans_b=True) * within
        o = _dot(scores, v_ref[...], cfg) + start[:, None] * _dot(q, s0_ref[...], cfg)
        o_ref[...] = o.astype(o_ref.dtype)

    return kernel


def _chunk_grads(cfg, q, k, v, do, s0, ds, decays, store):
    """dq, dk, dv and dλ of one chunk (module docstring) from its tiles, its S₀ and its dS (float32), each handed to
    ``store(name, value)`` as soon as it is formed (fewer live tiles: the backward is register-bound)."""
    within, start, end, keep, lower = decays
    qk = _dot(q, k, cfg, trans_b=True)
    g = _dot(do, v, cfg, trans_b=True) * within  # G = D ⊙ (dO Vᵀ)
    store("dq", _dot(g, k, cfg) + start[:, None] * _dot(do, s0, cfg, trans_b=True))
    store("dk", _dot(g, q, cfg, trans_a=True) + end[:, None] * _dot(v, ds, cfg, trans_b=True))
    pair = g * qk
    d_cum = jnp.sum(pair, axis=1) - jnp.sum(pair, axis=0)
    k_ds = _dot(k, ds, cfg)  # [C, P]
    store("dv", _dot(qk * within, do, cfg, trans_a=True) + end[:, None] * k_ds)
    d_end = jnp.sum(v.astype(F32) * k_ds, axis=1) * end
    d_cum = d_cum - d_end + jnp.sum(do.astype(F32) * _dot(q, s0, cfg), axis=1) * start
    d_total = jnp.sum(d_end) + jnp.sum(s0.astype(F32) * ds) * keep  # at position L: every λ_s has s ≤ L
    store("dλ", jnp.sum(jnp.where(lower, d_cum[:, None], 0.0), axis=0) + d_total)


def _state_grad_kernel(cfg, n_chunks):
    """Backward, pass 1: the chunks in reverse, storing dS (the gradient of each chunk's S_end) before
    stepping it to the chunk's start: dS₀ = (e ⊙ Q)ᵀ dO + γ dS."""
    c = cfg.chunk

    def kernel(q_ref, log_decay_ref, document_ref, carried_ref, do_ref, ds_final_ref, ds_ref, ds_init_ref):
        def body(step, ds):
            n = n_chunks - 1 - step
            rows = pl.ds(n * c, c)
            _, start, _, keep, _ = _chunk_decays(log_decay_ref[rows].astype(F32), document_ref[rows], carried_ref[n], c)
            ds_ref[n] = ds.astype(ds_ref.dtype)
            return _dot(q_ref[rows, :].astype(F32) * start[:, None], do_ref[rows, :], cfg, trans_a=True) + keep * ds

        ds_init_ref[...] = jax.lax.fori_loop(0, n_chunks, body, ds_final_ref[...].astype(F32))

    return kernel


def _chunk_grad_kernel(cfg):
    """Backward, pass 2: one program per (head, chunk, row) forms dq, dk, dv and dλ from the chunk's inputs,
    its S₀ (saved by the forward) and its dS (pass 1); nothing is carried between chunks."""

    def kernel(q_ref, k_ref, v_ref, log_decay_ref, document_ref, carried_ref, s0_ref, ds_ref, do_ref,
               dq_ref, dk_ref, dv_ref, d_log_decay_ref):
        outputs = {"dq": dq_ref, "dk": dk_ref, "dv": dv_ref, "dλ": d_log_decay_ref}

        def store(name, value):
            outputs[name][...] = value.astype(outputs[name].dtype)

        decays = _this_chunk_decays(cfg, log_decay_ref, document_ref, carried_ref)
        _chunk_grads(cfg, q_ref[...], k_ref[...], v_ref[...], do_ref[...], s0_ref[...], ds_ref[...].astype(F32),
                     decays, store)

    return kernel


# ---------------------------------------------------------------------------------------------------------
# launches


def _specs(cfg, t, n_chunks, key_dim, value_dim):
    """BlockSpecs on the (H, B) grid (:func:`_grid`), index maps written as (b, h): q/k rows of the head's
    group, v/o rows of the head, λ [B, H, T] rows, documents [B, T] and carried-in documents [B, N], per-head
    states and per-chunk starts."""
    hpg = cfg.heads_per_group

    def spec(shape, index):
        return pl.BlockSpec(shape, lambda h, b: index(b, h))

    return dict(
        keys=spec((None, t, None, key_dim), lambda b, h: (b, 0, h // hpg, 0)),
        values=spec((None, t, None, value_dim), lambda b, h: (b, 0, h, 0)),
        decay=spec((None, None, t), lambda b, h: (b, h, 0)),
        documents=spec((None, t), lambda b, h: (b, 0)),
        carried=spec((None, n_chunks), lambda b, h: (b, 0)),
        state=spec((None, None, key_dim, value_dim), lambda b, h: (b, h, 0, 0)),
        starts=spec((None, None, n_chunks, key_dim, value_dim), lambda b, h: (b, h, 0, 0, 0)))


def _chunk_specs(cfg, n_chunks, key_dim, value_dim):
    """BlockSpecs of one chunk on the grid (H, chunks, B), index maps written as (b, h, n): q/k rows of the head's
    group, dq/dk rows per head, v/o rows, λ, documents, the row's carried-in documents, one [N, P] state."""
    c, hpg = cfg.chunk, cfg.heads_per_group

    def spec(shape, index):
        return pl.BlockSpec(shape, lambda hh, n, bb: index(bb, hh, n))

    return (spec((None, c, None, key_dim), lambda b, h, n: (b, n, h // hpg, 0)),
            spec((None, c, None, key_dim), lambda b, h, n: (b, n, h, 0)),
            spec((None, c, None, value_dim), lambda b, h, n: (b, n, h, 0)),
            spec((None, None, c), lambda b, h, n: (b, h, n)),
            spec((None, c), lambda b, h, n: (b, n)),
            spec((None, n_chunks), lambda b, h, n: (b, 0)),
            spec((None, None, None, key_dim, value_dim), lambda b, h, n: (b, h, n, 0, 0)))


def _grid(b, h):
    """(H, B): the first axis varies fastest in launch order, so the programs in flight are the heads of a few
    rows, and a group's heads read the same q and k chunks at the same pace (L2 hits). 8 % faster forward +
    backward than (B, H) for Mamba-2 166M on an H100 (docs/math/ssd.md)."""
    return (h, b)


def _forward_cost(cfg, b, h, t, n, p, itemsize):
    """The chunk algorithm's own counts: its four matmuls per chunk (Q Kᵀ, (·) V, Q S₀, Kᵀ V), one exp per pair
    and token, every operand read or written once (q and k once per head: the group's repeats may come from L2,
    so this is an upper bound on HBM bytes)."""
    c, chunks = cfg.chunk, t // cfg.chunk
    flops = t * (2 * c * n + 2 * c * p + 4 * n * p)
    io = (2 * t * n + 2 * t * p + chunks * n * p) * itemsize + 8 * t + 8 * n * p
    return pl.CostEstimate(flops=int(b * h * flops), transcendentals=int(b * h * t * (c + 2)),
                           bytes_accessed=int(b * h * io))


def _scan_cost(cfg, b, h, t, n, p, itemsize):
    """The two scans over the chunks (the split forward's S, the backward's dS): one [N, P] product per token's
    share of a chunk, the chunk decays' exps, the scanned input rows read once and one state per chunk written."""
    c, chunks = cfg.chunk, t // cfg.chunk
    return pl.CostEstimate(flops=int(b * h * t * 2 * n * p), transcendentals=int(b * h * t * (c + 2)),
                           bytes_accessed=int(b * h * ((t * n + t * p + chunks * n * p) * itemsize
                                                       + 8 * t + 8 * n * p)))


def _forward(cfg, q, k, v, log_decay, state, document, carried, save_starts):
    b, t, _, key_dim = q.shape
    h, value_dim = v.shape[2], v.shape[3]
    if cfg.split_forward:
        return _split_forward(cfg, q, k, v, log_decay, state, document, carried, save_starts)
    n_chunks = t // cfg.chunk
    s = _specs(cfg, t, n_chunks, key_dim, value_dim)
    out_shape = [jax.ShapeDtypeStruct(v.shape, v.dtype), jax.ShapeDtypeStruct((b, h, key_dim, value_dim), F32)]
    out_specs = [s["values"], s["state"]]
    if save_starts:
        out_shape.append(jax.ShapeDtypeStruct((b, h, n_chunks, key_dim, value_dim), cfg.operand_dtype))
        out_specs.append(s["starts"])
    return pl.pallas_call(
        _forward_kernel(cfg, n_chunks, save_starts), grid=_grid(b, h), out_shape=tuple(out_shape),
        in_specs=[s["keys"], s["keys"], s["values"], s["decay"], s["documents"], s["carried"], s["state"]],
        out_specs=tuple(out_specs), interpret=cfg.interpret,
        compiler_params=compiler_params(cfg.interpret, cfg.warps_forward, cfg.stages),
        cost_estimate=_forward_cost(cfg, b, h, t, key_dim, value_dim, jnp.dtype(v.dtype).itemsize),
        name="ssd_forward")(q, k, v, log_decay, document, carried, state)


def _split_forward(cfg, q, k, v, log_decay, state, document, carried, save_starts):
    """Pass 1 (grid (H, B), the state scan storing every chunk's S₀) and pass 2 (grid (H, chunks, B), every
    chunk's outputs at once)."""
    b, t, _, key_dim = q.shape
    h, value_dim = v.shape[2], v.shape[3]
    c, n_chunks = cfg.chunk, t // cfg.chunk
    s = _specs(cfg, t, n_chunks, key_dim, value_dim)
    itemsize = jnp.dtype(v.dtype).itemsize
    starts, final = pl.pallas_call(
        _state_kernel(cfg, n_chunks), grid=_grid(b, h),
        out_shape=(jax.ShapeDtypeStruct((b, h, n_chunks, key_dim, value_dim), cfg.operand_dtype),
                   jax.ShapeDtypeStruct((b, h, key_dim, value_dim), F32)),
        in_specs=[s["keys"], s["values"], s["decay"], s["documents"], s["carried"], s["state"]],
        out_specs=(s["starts"], s["state"]), interpret=cfg.interpret,
        compiler_params=compiler_params(cfg.interpret, cfg.warps_forward, cfg.stages),
        cost_estimate=_scan_cost(cfg, b, h, t, key_dim, value_dim, itemsize),
        name="ssd_forward_states")(k, v, log_decay, document, carried, state)
    keys, _, values, decay, documents, carried_spec, chunk_state = _chunk_specs(cfg, n_chunks, key_dim, value_dim)
    out = pl.pallas_call(
        _output_kernel(cfg), grid=(h, n_chunks, b), out_shape=jax.ShapeDtypeStruct(v.shape, v.dtype),
        in_specs=[keys, keys, values, decay, documents, carried_spec, chunk_state], out_specs=values,
        interpret=cfg.interpret, compiler_params=compiler_params(cfg.interpret, cfg.warps_forward, cfg.stages),
        cost_estimate=pl.CostEstimate(
            flops=int(b * h * t * (2 * c * key_dim + 2 * c * value_dim + 2 * key_dim * value_dim)),
            transcendentals=int(b * h * t * (c + 2)),
            bytes_accessed=int(b * h * ((2 * t * key_dim + 2 * t * value_dim + n_chunks * key_dim * value_dim)
                                        * itemsize + 8 * t))),
        name="ssd_forward_chunks")(q, k, v, log_decay, document, carried, starts)
    return (out, final, starts) if save_starts else (out, final)


def _backward(cfg, q, k, v, log_decay, document, carried, starts, d_out, d_final):
    """Pass 1 (grid (H, B), the dS scan) and pass 2 (grid (H, chunks, B), every chunk at once)."""
    b, t, _, key_dim = q.shape
    h, value_dim = v.shape[2], v.shape[3]
    c, n_chunks = cfg.chunk, t // cfg.chunk
    s = _specs(cfg, t, n_chunks, key_dim, value_dim)
    itemsize = jnp.dtype(v.dtype).itemsize
    state_shape = jax.ShapeDtypeStruct((b, h, key_dim, value_dim), F32)
    d_states, d_state = pl.pallas_call(
        _state_grad_kernel(cfg, n_chunks), grid=_grid(b, h),
        out_shape=(jax.ShapeDtypeStruct(starts.shape, starts.dtype), state_shape),
        in_specs=[s["keys"], s["decay"], s["documents"], s["carried"], s["values"], s["state"]],
        out_specs=(s["starts"], s["state"]), interpret=cfg.interpret,
        compiler_params=compiler_params(cfg.interpret, cfg.warps_forward, cfg.stages),
        cost_estimate=_scan_cost(cfg, b, h, t, key_dim, value_dim, itemsize),
        name="ssd_backward_states")(q, log_decay, document, carried, d_out, d_final)

    keys, keys_per_head, values, decay, documents, carried_spec, chunk_state = _chunk_specs(cfg, n_chunks, key_dim,
                                                                                          value_dim)
    per_head_keys = jax.ShapeDtypeStruct((b, t, h, key_dim), cfg.operand_dtype)
    grads_cost = pl.CostEstimate(
        flops=int(b * h * t * (6 * c * key_dim + 4 * c * value_dim + 10 * key_dim * value_dim)),
        transcendentals=int(b * h * t * (c + 2)),
        bytes_accessed=int(b * h * ((4 * t * key_dim + 3 * t * value_dim + 2 * n_chunks * key_dim * value_dim)
                                    * itemsize + 12 * t)))
    dq, dk, dv, d_log_decay = pl.pallas_call(
        _chunk_grad_kernel(cfg), grid=(h, n_chunks, b),
        out_shape=(per_head_keys, per_head_keys, jax.ShapeDtypeStruct(v.shape, v.dtype),
                   jax.ShapeDtypeStruct(log_decay.shape, F32)),
        in_specs=[keys, keys, values, decay, documents, carried_spec, chunk_state, chunk_state, values],
        out_specs=(keys_per_head, keys_per_head, values, decay), interpret=cfg.interpret,
        compiler_params=compiler_params(cfg.interpret, cfg.warps_backward, cfg.stages), cost_estimate=grads_cost,
        name="ssd_backward_chunks")(q, k, v, log_decay, document, carried, starts, d_states, d_out)
    return dq, dk, dv, d_log_decay, d_state


# ---------------------------------------------------------------------------------------------------------
# custom VJP (padded inputs; λ as [B, H, T] float32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ssd(cfg, q, k, v, log_decay, state, document, carried):
    out, final = _forward(cfg, q, k, v, log_decay, state, document, carried, save_starts=False)
    return out, final


def _ssd_fwd(cfg, q, k, v, log_decay, state, document, carried):
    out, final, starts = _forward(cfg, q, k, v, log_decay, state, document, carried, save_starts=True)
    out, final, starts = common.keep_for_backward((out, final, starts))
    return (out, final), (q, k, v, log_decay, state, document, carried, starts)


def _ssd_bwd(cfg, residuals, cotangents):
    q, k, v, log_decay, state, document, carried, starts = residuals
    d_out, d_final = cotangents
    dq, dk, dv, d_log_decay, d_state = _backward(cfg, q, k, v, log_decay, document, carried, starts,
                                                d_out.astype(v.dtype), d_final.astype(F32))
    b, t, g, n = q.shape
    hpg = cfg.heads_per_group

    def group_sum(x):  # per-head [B, T, H, N] -> per-group [B, T, G, N], summed in float32
        return x.reshape(b, t, g, hpg, n).astype(F32).sum(axis=3).astype(q.dtype)

    return (group_sum(dq), group_sum(dk), dv, d_log_decay.astype(log_decay.dtype), d_state.astype(state.dtype),
            None, None)


_ssd.defvjp(_ssd_fwd, _ssd_bwd)


# ---------------------------------------------------------------------------------------------------------
# public entry (the op's impl.run contract)


def run(q, k, v, log_decay, state, document_BT, *, chunk_size, interpret=False, **overrides):
    """q, k [B, T, G, N]; v [B, T, H, P] (one float dtype); log_decay [B, T, H] ≤ 0; state [B, H, N, P];
    document_BT [B, T] int32. Returns (o [B, T, H, P] in v's dtype, final_state [B, H, N, P] float32).
    Differentiable (custom VJP). ``overrides``: :class:`Config` fields (warps, stages)."""
    b, t, g, _ = q.shape
    h = v.shape[2]
    cfg = make_config(chunk_size, v.dtype, h // g, interpret=interpret, **overrides)
    q, k, v = (common.pad_time(x, chunk_size) for x in (q, k, v))
    log_decay_BHT = jnp.swapaxes(common.pad_time(log_decay.astype(F32), chunk_size), 1, 2)
    document = common.pad_time(document_BT.astype(jnp.int32), chunk_size, mode="edge")
    _, carried = common.chunk_documents(document, chunk_size)
    out, final = _ssd(cfg, q, k, v, log_decay_BHT, state.astype(F32), document, carried)
    return out[:, :t], final
