"""What every evaluation writes: a markdown table for stdout and docs, a JSON file (written atomically, numpy
values converted) and matplotlib figures (Agg backend: no display needed)."""
from __future__ import annotations

import json
import math
import os

import numpy as np

from mixerlab.training import storage


def format_value(x, digits: int = 4) -> str:
    """Numbers with ``digits`` significant digits (scientific outside [1e-3, 1e6)); anything else as str."""
    if isinstance(x, (bool, np.bool_)) or x is None:
        return str(x)
    if isinstance(x, (int, np.integer)):
        return str(int(x))
    if isinstance(x, (float, np.floating)):
        x = float(x)
        if not math.isfinite(x) or x == 0.0:
            return str(x)
        if 1e-3 <= abs(x) < 1e6:
            return f"{x:.{digits}g}"
        return f"{x:.{max(digits - 1, 1)}e}"
    return str(x)


def table(headers: list[str], rows: list[list], title: str = "") -> str:
    """A fixed-width text table (markdown pipe syntax, so it can be pasted into docs)."""
    cells = [[format_value(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    line = lambda items: "| " + " | ".join(s.ljust(w) for s, w in zip(items, widths)) + " |"  # noqa: E731
    out = [title] if title else []
    out += [line(headers), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    out += [line(r) for r in cells]
    return "\n".join(out)


def _jsonable(x):
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if hasattr(x, "tolist"):  # numpy / jax arrays and scalars
        return _jsonable(np.asarray(x).tolist())
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)  # JSON has no inf / nan
    return x


def write_json(path: str, payload: dict) -> str:
    """``payload`` as indented JSON (a local path or a gs:// / s3:// URL); a reader (or a crash) never sees half
    a file."""
    if storage.is_url(path):
        storage.write_text(path, json.dumps(_jsonable(payload), indent=1), "output")
        return path
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(_jsonable(payload), f, indent=1)
    os.replace(tmp, path)
    return path


def pyplot():
    """matplotlib.pyplot on the Agg backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def new_figure(ncols: int, width: float = 5.0, height: float = 3.8):
    """A matplotlib figure with ``ncols`` side-by-side axes."""
    fig, axes = pyplot().subplots(1, ncols, figsize=(width * ncols, height), squeeze=False)
    return fig, list(axes[0])


def save_figure(fig, path: str, dpi: int = 120) -> str:
    """Saves ``fig`` as ``path`` (a local path or a URL: written locally, then uploaded)."""
    fig.tight_layout()
    with storage.local_output(path, "output") as local:
        fig.savefig(local, dpi=dpi)
    pyplot().close(fig)
    return path


def parse_int_list(text: str, name: str) -> list[int]:
    """'0,1,2' -> [0, 1, 2]; a ValueError naming the option otherwise."""
    try:
        values = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise ValueError(f"{name}={text!r}: expected comma-separated integers, e.g. 0,1,2") from None
    if not values:
        raise ValueError(f"{name}={text!r}: expected at least one integer")
    return values
