"""Make the shared helper module (delta_rule_cases.py) importable whatever import mode pytest resolves for
this folder (with the repo root on sys.path pytest names these modules tests.pallas_kernels.*)."""
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
