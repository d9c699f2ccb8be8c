"""Fail-closed choice of an op's implementation.

Every op keeps an :class:`OpTable`: the implementations it has, each with a ``supports(call) -> None | reason``
predicate, plus the names that are planned but not built yet. ``choose(requested, call)``:

* ``"auto"`` tries the fast candidates in order (Pallas kernels first), logs ONE line per rejected candidate
  and reason, once per process (not once per layer)
  (``logging`` at INFO, logger ``pallas_kernels.dispatch``) and falls back to the op's portable fallback
  (``"xla"``), which must accept every valid call;
* an explicit name is served or refused with ONE ``ValueError`` naming the implementation, the reason and
  the valid choices (unknown name, planned-but-missing kernel, or a ``supports`` rejection such as a
  backend mismatch).

``call`` is whatever record the op builds from its validated arguments (shapes, dtypes, backend, ...); the
table does not look inside it.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable, Optional

logger = logging.getLogger(__name__)

AUTO = "auto"


@dataclasses.dataclass(frozen=True)
class Implementation:
    name: str
    run: Callable[..., Any]
    supports: Callable[[Any], Optional[str]] = lambda call: None
    fast: bool = False  # tried by "auto" before the fallback


class OpTable:
    def __init__(self, op: str, *, fallback: str, planned: tuple[str, ...] = ()):
        self.op = op
        self.fallback = fallback
        self.planned = tuple(planned)  # names that exist in the design but have no kernel yet
        self._impls: dict[str, Implementation] = {}
        self._logged: set[tuple[str, str]] = set()  # (kernel, reason) already logged: once per process, not per layer

    def register(self, impl: Implementation) -> Implementation:
        if impl.name == AUTO or impl.name in self._impls:
            raise ValueError(f"{self.op}: implementation name {impl.name!r} is reserved or already registered")
        self._impls[impl.name] = impl
        return impl

    def names(self) -> list[str]:
        return [AUTO, *self._impls]

    def _refuse(self, name: str, reason: str) -> ValueError:
        return ValueError(
            f"{self.op}: implementation={name!r} cannot serve this call: {reason}. "
            f"Valid choices: {', '.join(repr(n) for n in self.names())}."
        )

    def choose(self, requested: str, call: Any) -> Implementation:
        if requested == AUTO:
            return self._auto(call)
        if not isinstance(requested, str):
            raise self._refuse(repr(requested), "the implementation must be a string")
        impl = self._impls.get(requested)
        if impl is None:
            if requested in self.planned:
                raise self._refuse(requested, "this kernel is planned but not implemented yet")
            raise self._refuse(requested, "unknown implementation name")
        reason = impl.supports(call)
        if reason is not None:
            raise self._refuse(requested, reason)
        return impl

    def _auto(self, call: Any) -> Implementation:
        candidates = [n for n in self.planned if n not in self._impls]
        candidates += [n for n, impl in self._impls.items() if impl.fast]
        # Registered fast kernels in registration order first; missing planned ones are only logged.
        for name in sorted(candidates, key=lambda n: n not in self._impls):
            impl = self._impls.get(name)
            reason = "not implemented yet" if impl is None else impl.supports(call)
            if reason is None:
                return impl
            if (name, reason) not in self._logged:
                self._logged.add((name, reason))
                logger.info("%s: auto skipped %s: %s", self.op, name, reason)
        fallback = self._impls[self.fallback]
        reason = fallback.supports(call)
        if reason is not None:  # the fallback must serve every validated call; this is a bug if it fires
            raise self._refuse(self.fallback, reason)
        return fallback


def bad_argument(op: str, name: str, x, expected: str) -> ValueError:
    """The one error an op raises for a bad argument: the op, the argument, what it got, what was expected."""
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        import numpy as np

        got = f"shape {tuple(x.shape)} dtype {np.dtype(x.dtype).name}"
    else:
        got = repr(x)
    return ValueError(f"{op}: argument {name!r} has {got}; expected {expected}")


def check_float(op: str, name: str, x) -> None:
    import jax.numpy as jnp

    if not hasattr(x, "shape") or not jnp.issubdtype(x.dtype, jnp.floating):
        raise bad_argument(op, name, x, "a floating-point array")


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
        if x.dtype != q.dtype:
            import numpy as np

            raise bad_argument(op, name, x, f"dtype {np.dtype(q.dtype).name} (the dtype of q)")
    return b, t, h, dk, dv


_TARGET_BACKEND: list[str] = []


def target_backend() -> str:
    """The backend the ops are being built for: JAX's default backend, unless ``compiling_for`` says otherwise
    (an ahead-of-time compile for TPU from a CPU host must pick the TPU kernels)."""
    import jax

    return _TARGET_BACKEND[-1] if _TARGET_BACKEND else jax.default_backend()


class compiling_for:
    """``with dispatch.compiling_for("tpu"): jax.jit(f).lower(...)`` — trace the ops for another backend."""

    def __init__(self, backend: str):
        self.backend = backend

    def __enter__(self):
        _TARGET_BACKEND.append(self.backend)
        return self

    def __exit__(self, *exc):
        _TARGET_BACKEND.pop()
        return False
