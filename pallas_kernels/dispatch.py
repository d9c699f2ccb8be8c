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

    def get(self, name: str) -> Implementation:
        """The registered implementation ``name`` (for an op that runs another op's implementation directly)."""
        if name not in self._impls:
            raise self._refuse(name, "unknown implementation name")
        return self._impls[name]

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


def target_backend() -> str:
    """The platform the ops are traced for: that of the device mesh in context (the trainer traces its step
    under ``jax.sharding.use_abstract_mesh(mesh)``, so an ahead-of-time compile for a TPU topology from a CPU
    host picks the TPU kernels, as it would on the TPU itself), else JAX's default backend."""
    import jax

    mesh = jax.sharding.get_abstract_mesh()
    device = getattr(mesh, "abstract_device", None)
    if not mesh.empty and device is not None and device.platform:
        return device.platform
    return jax.default_backend()
