"""Name -> (mixer class, options dataclass). The only place a config string becomes a mixer.

Mixers register themselves with ``@register("name", Options)``; ``mixers/__init__.py`` imports every mixer
module so that the registry is complete once ``mixers`` is imported.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, NamedTuple


class Entry(NamedTuple):
    cls: type
    options: type  # a frozen dataclass; its fields are the config keys mixers.<name>.<field>


_REGISTRY: dict[str, Entry] = {}


def register(name: str, options: type) -> Callable[[type], type]:
    if not dataclasses.is_dataclass(options):
        raise TypeError(f"mixer {name!r}: options must be a dataclass, got {options!r}")

    def wrap(cls: type) -> type:
        if name in _REGISTRY and _REGISTRY[name].cls is not cls:
            raise ValueError(f"mixer name {name!r} registered twice ({_REGISTRY[name].cls.__name__}, {cls.__name__})")
        _REGISTRY[name] = Entry(cls, options)
        return cls

    return wrap


def names() -> list[str]:
    return sorted(_REGISTRY)


def get(name: str) -> Entry:
    if name not in _REGISTRY:
        raise KeyError(f"unknown mixer {name!r}; registered mixers: {', '.join(names())}")
    return _REGISTRY[name]


def build(name: str, spec, options=None, *, rngs):
    entry = get(name)
    return entry.cls(spec, options if options is not None else entry.options(), rngs=rngs)
