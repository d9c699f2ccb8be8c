"""What every op and every backend shares: argument checks, the dtype policy, the document index and the
chunk layout of packed documents. One home, so that changing how documents reset is one edit.

Vocabulary (docs/math/README.md):
  * ``document_BT`` — the document index: the running count of segment boundaries up to and including t
    (t is a boundary iff seg[t] != seg[t−1]). Two tokens share a document iff their counts are equal, so a
    segment id reused after another segment still starts a new document.
  * ``carried_document`` — per chunk, the document the state entering the chunk belongs to: that of the
    token just before the chunk (chunk 0: that of token 0, so an initial state belongs to the first
    document of its row).
"""
from __future__ import annotations

import numbers
import os

import jax
import jax.numpy as jnp
import numpy as np

# ---------------------------------------------------------------------------------------------------------
# argument checks: one error form for every op


def bad_argument(op: str, name: str, x, expected: str) -> ValueError:
    """The one error an op raises for a bad argument: the op, the argument, what it got, what was expected."""
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        got = f"shape {tuple(x.shape)} dtype {np.dtype(x.dtype).name}"
    else:
        got = repr(x)
    return ValueError(f"{op}: argument {name!r} has {got}; expected {expected}")


def is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def is_real(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def check_float(op: str, name: str, x) -> None:
    if not hasattr(x, "shape") or not jnp.issubdtype(x.dtype, jnp.floating):
        raise bad_argument(op, name, x, "a floating-point array")


def check_shape(op: str, name: str, x, shape, labels) -> None:
    """``x`` is a float array of exactly ``shape``; ``labels`` name the axes in the message (e.g. "BTHK")."""
    check_float(op, name, x)
    if tuple(x.shape) != tuple(shape):
        wanted = "[" + ", ".join(f"{label}={size}" for label, size in zip(labels, shape)) + "]"
        raise bad_argument(op, name, x, f"shape {wanted}")


def check_same_dtype(op: str, name: str, x, reference_name: str, reference) -> None:
    if x.dtype != reference.dtype:
        raise bad_argument(op, name, x, f"dtype {np.dtype(reference.dtype).name} (the dtype of {reference_name})")


def check_qkv(op: str, q, k, v) -> tuple[int, int, int, int, int]:
    """The checks every token-mixer op makes on q, k [B, T, H, Dk] and v [B, T, H, Dv]: floating point, one
    dtype, matching B, T, H (and Dk for k), nothing empty. Returns (B, T, H, Dk, Dv)."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        check_float(op, name, x)
        if x.ndim != 4:
            raise bad_argument(op, name, x, "rank 4 [B, T, H, D]")
    b, t, h, dk = q.shape
    if tuple(k.shape) != (b, t, h, dk):
        raise bad_argument(op, "k", k, f"shape [B={b}, T={t}, H={h}, Dk={dk}] (as q)")
    if tuple(v.shape[:3]) != (b, t, h):
        raise bad_argument(op, "v", v, f"shape [B={b}, T={t}, H={h}, Dv] (B, T, H as in q)")
    dv = v.shape[3]
    if t < 1 or dk < 1 or dv < 1:
        raise bad_argument(op, "q", q, "non-empty T, Dk and Dv")
    for name, x in (("k", k), ("v", v)):
        check_same_dtype(op, name, x, "q", q)
    return b, t, h, dk, dv


def check_segment_ids(op: str, segment_ids, batch: int, length: int) -> None:
    if segment_ids is None:
        return
    if not hasattr(segment_ids, "shape") or not jnp.issubdtype(segment_ids.dtype, jnp.integer):
        raise bad_argument(op, "segment_ids", segment_ids, f"an integer array of shape [B={batch}, T={length}]")
    if tuple(segment_ids.shape) != (batch, length):
        raise bad_argument(op, "segment_ids", segment_ids, f"shape [B={batch}, T={length}]")


# ---------------------------------------------------------------------------------------------------------
# what a kernel keeps for its backward pass, named for rematerialisation policies

KERNEL_RESIDUALS = "mixer_kernel_residuals"


def keep_for_backward(tree):
    """Tag a custom-VJP forward's outputs and residuals with :data:`KERNEL_RESIDUALS`, so that a remat policy
    (``model.remat=kernels`` or ``dots``) can keep them: the backward pass then recomputes the cheap work of a
    block (projections, convolutions, norms) but never runs a mixer kernel's forward a second time."""
    from jax.ad_checkpoint import checkpoint_name
    return jax.tree.map(lambda x: checkpoint_name(x, KERNEL_RESIDUALS), tree)


# ---------------------------------------------------------------------------------------------------------
# value domains (λ ≤ 0, r ≤ 0, positive-definite A₀). Concrete values: a ValueError now. Under jit: the op's
# outputs become NaN when the domain is violated (computed on the device: no host sync, so the training step
# stays asynchronous; the trainer reports non-finite steps), and with MIXERLAB_CHECK_DOMAINS=1 a host
# callback raises the same ValueError at run time (it syncs with the host once per op call: debugging only).
# Never a silent wrong answer.

CHECK_DOMAINS_UNDER_JIT = os.environ.get("MIXERLAB_CHECK_DOMAINS", "0") == "1"


def _domain_error(op: str, name: str, expected: str, worst) -> ValueError:
    return ValueError(f"{op}: argument {name!r} is outside its domain: expected {expected}; found {worst}")


def _check_domain(op: str, name: str, expected: str, violation, summary, under_jit: bool = True):
    """``violation`` (bool scalar) and ``summary`` (a scalar for the message) are computed from the argument.
    Concrete: raise now, return None. Traced: return ``violation`` for :func:`poison` (and raise at run time
    through ``jax.debug.callback`` when MIXERLAB_CHECK_DOMAINS=1)."""
    if not isinstance(violation, jax.core.Tracer):
        if bool(violation):
            raise _domain_error(op, name, expected, np.asarray(summary).item())
        return None
    if under_jit and CHECK_DOMAINS_UNDER_JIT:
        def raise_if(bad, worst):
            if bool(bad):
                raise _domain_error(op, name, expected, np.asarray(worst).item())

        jax.debug.callback(raise_if, violation, summary)
    return violation


def check_nonpositive(op: str, name: str, x, *, under_jit: bool = True):
    """Every entry ≤ 0 (log-decays, log-moduli); NaN counts as a violation. Returns the traced violation flag
    under jit (None otherwise) for :func:`poison`. ``under_jit=False`` never adds a host callback (one-token
    decode steps, where one per layer and token would cost latency)."""
    if x is None:
        return None
    worst = jnp.max(jnp.where(jnp.isnan(x), jnp.inf, x))
    return _check_domain(op, name, "every entry <= 0", worst > 0, worst, under_jit)


def poison(violation, *arrays):
    """The arrays, all NaN where ``violation`` (a traced domain check) is true; unchanged when it is None."""
    if violation is None:
        return arrays
    return tuple(jnp.where(violation, jnp.asarray(jnp.nan, x.dtype), x) for x in arrays)


def _not_positive_definite(a) -> tuple[bool, float]:
    """Host-side (numpy): (violated, smallest eigenvalue). numpy, not jnp.linalg: LAPACK calls inside an XLA
    CPU program can deadlock XLA's thread pool (see pallas_kernels/vla/small_linalg.py)."""
    a = np.asarray(a, np.float64)
    sym = 0.5 * (a + np.swapaxes(a, -1, -2))
    if not np.all(np.isfinite(a)):
        return True, float("nan")
    smallest = float(np.min(np.linalg.eigvalsh(sym))) if a.size else 1.0
    asymmetric = np.max(np.abs(a - sym), initial=0.0) > 1e-5 * max(np.max(np.abs(a), initial=0.0), 1e-30)
    return bool(smallest <= 0 or asymmetric), smallest


def check_positive_definite(op: str, name: str, a_KK) -> None:
    """A symmetric positive-definite stack [..., K, K] (e.g. VLA's initial penalty A₀)."""
    if a_KK is None:
        return
    expected = "symmetric positive-definite matrices (smallest eigenvalue > 0)"
    if not isinstance(a_KK, jax.core.Tracer):
        bad, smallest = _not_positive_definite(a_KK)
        if bad:
            raise _domain_error(op, name, expected, smallest)
        return
    if not CHECK_DOMAINS_UNDER_JIT:  # a traced A₀ is checked with MIXERLAB_CHECK_DOMAINS=1 only (host eigvalsh)
        return

    def raise_if(a):
        bad, smallest = _not_positive_definite(a)
        if bad:
            raise _domain_error(op, name, expected, smallest)

    jax.debug.callback(raise_if, a_KK)


# ---------------------------------------------------------------------------------------------------------
# dtype policy


def compute_dtype(dtype):
    """float64 end-to-end for float64 inputs; float32 state and accumulation for everything else."""
    return jnp.float64 if jnp.dtype(dtype) == jnp.float64 else jnp.float32


# ---------------------------------------------------------------------------------------------------------
# packed documents and the chunk layout


def document_index(segment_ids, batch: int, length: int):
    """[B, T] int32 running count of segment boundaries (see the module docstring); zeros without segments."""
    if segment_ids is None:
        return jnp.zeros((batch, length), jnp.int32)
    boundary = (segment_ids[:, 1:] != segment_ids[:, :-1]).astype(jnp.int32)
    return jnp.concatenate([jnp.zeros((batch, 1), jnp.int32), jnp.cumsum(boundary, axis=1)], axis=1)


def pad_time(x_BT_, multiple: int, mode: str = "constant"):
    """Pad axis 1 (time) up to a multiple: zeros (tokens with λ = 0 and no input are identity transitions)
    or ``mode="edge"`` for document indices (padding stays in the last document)."""
    extra = -x_BT_.shape[1] % multiple
    if extra == 0:
        return x_BT_
    widths = [(0, 0)] * x_BT_.ndim
    widths[1] = (0, extra)
    return jnp.pad(x_BT_, widths, mode=mode)


def chunk_documents(document_BT, chunk_size: int):
    """[B, T] document index (T a multiple of the chunk) -> (per chunk [B, N, C], carried document [B, N])."""
    b, t = document_BT.shape
    chunks = document_BT.reshape(b, t // chunk_size, chunk_size)
    carried = jnp.concatenate([chunks[:, :1, 0], chunks[:, :-1, -1]], axis=1)
    return chunks, carried


# ---------------------------------------------------------------------------------------------------------
# running a kernel under a device mesh


def mesh_axes(split_size: int):
    """For a kernel run per shard under the device mesh in context: (mesh, the batch axes (data, fsdp) or None,
    "tensor" when that axis divides ``split_size`` (heads or channels) else None); None without a mesh."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1:
        return None
    names = mesh.axis_names
    batch = tuple(a for a in ("data", "fsdp") if a in names) or None
    split = "tensor" if "tensor" in names and split_size % mesh.shape["tensor"] == 0 else None
    return mesh, batch, split


def per_shard(run, heads: int, in_kinds: tuple, out_kinds):
    """Pallas kernels cannot be partitioned by XLA: under a device mesh in context (the trainer traces its step
    under ``jax.sharding.use_abstract_mesh``) run them per shard with ``shard_map`` — batch over (data, fsdp),
    heads over tensor when they divide. Argument kinds: "tokens" [B, T, H, ...], "token_heads" [B, T, H] (one
    number per token and head, e.g. a per-head decay), "state" [B, H, ...],
    "rows" [B, T], "heads" [H, ...] (per-head parameters); ``out_kinds`` is one kind or a tuple of kinds.
    Without a mesh, ``run`` itself."""
    axes = mesh_axes(heads)
    if axes is None:
        return run
    from jax.sharding import PartitionSpec as P

    mesh, batch, head = axes
    specs = {"tokens": P(batch, None, head, None), "state": P(batch, head, None, None), "rows": P(batch, None),
             "token_heads": P(batch, None, head),
             "heads": P(head)}
    out_specs = specs[out_kinds] if isinstance(out_kinds, str) else tuple(specs[k] for k in out_kinds)

    def wrapped(*args, **static):
        f = jax.shard_map(lambda *a: run(*a, **static), mesh=mesh, check_vma=False,
                          in_specs=tuple(specs[k] for k in in_kinds), out_specs=out_specs)
        return f(*args)

    return wrapped
