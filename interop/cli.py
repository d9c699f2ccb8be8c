"""What both console scripts share: they print the lines their action yields. Failures follow the project's one
rule for console scripts (training/cli_errors.py, applied by ``@entry_point`` on each ``main``): one line on
stderr; exit 2 for a refused setting, a bad argument or a missing run, 1 for anything else that failed."""
from __future__ import annotations


def run(action) -> int:
    for line in action():
        print(line)
    return 0
