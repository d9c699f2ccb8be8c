"""Where ``--config NAME`` points: a file on disk, else one of the configs shipped inside the package.

The repository's ``configs/`` folder is ``mixerlab/configs`` in a checkout (a symlink) and in an installed wheel
(package data), so ``mixerlab-train --config paper/muir_166m`` works outside a checkout too. Their ``inherit:``
names are relative to the file that holds them, so a packaged config's chain stays inside the package.
"""
from __future__ import annotations

import os

import mixerlab

from .config import ConfigError

PACKAGED_CONFIGS = os.path.join(os.path.dirname(os.path.abspath(mixerlab.__file__)), "configs")
_SHOWN_NAMES = 8  # how many packaged names an error lists


def resolve_config_path(name: str) -> str:
    """The file ``name`` means: an existing path wins; otherwise a packaged config, written as ``base``,
    ``paper/muir_166m``, ``paper/muir_166m.yaml`` or ``configs/paper/muir_166m.yaml`` (the checkout's path)."""
    if os.path.isfile(name):
        return name
    for candidate in _packaged_candidates(name):
        if os.path.isfile(candidate):
            return candidate
    names = packaged_config_names()
    shown = ", ".join(names[:_SHOWN_NAMES]) + (f", ... ({len(names)} in all)" if len(names) > _SHOWN_NAMES else "")
    raise ConfigError(f"--config {name!r}: no such file (looked for {os.path.abspath(name)}) and no packaged config "
                      f"of that name (looked in {PACKAGED_CONFIGS}); packaged configs: {shown or 'none'}")


def _packaged_candidates(name: str) -> list[str]:
    if os.path.isabs(name):
        return []
    rel = os.path.normpath(name).replace(os.sep, "/")
    if rel.startswith("configs/"):
        rel = rel[len("configs/"):]
    if rel.startswith("../") or rel in ("", ".", ".."):
        return []
    path = os.path.join(PACKAGED_CONFIGS, rel)
    return [path] if rel.endswith((".yaml", ".yml")) else [path + ".yaml", path]


def packaged_config_names() -> list[str]:
    """``base``, ``tiny``, ``eval/copy``, ``paper/muir_166m`` ...: the runnable packaged configs, top folder first
    (files starting with ``_`` are shared parents, not runs of their own)."""
    names = []
    for folder, _, files in os.walk(PACKAGED_CONFIGS, followlinks=True):
        for file in files:
            if file.endswith(".yaml") and not file.startswith("_"):
                rel = os.path.relpath(os.path.join(folder, file), PACKAGED_CONFIGS).replace(os.sep, "/")
                names.append(rel[: -len(".yaml")])
    return sorted(names, key=lambda n: (n.count("/"), n))
