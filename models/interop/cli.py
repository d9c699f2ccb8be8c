"""What both console scripts share: one line on stderr and the exit status (2: a refused setting or a bad
argument; 1: anything else that failed at run time)."""
from __future__ import annotations

import sys

from mixerlab.models.interop.errors import InteropRefused
from mixerlab.training.config import ConfigError


def run(prog: str, action) -> int:
    try:
        for line in action():
            print(line)
    except (InteropRefused, ConfigError) as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return 2
    except (OSError, ValueError, KeyError, RuntimeError) as e:
        print(f"{prog}: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    return 0
