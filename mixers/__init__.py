"""Token mixers. Importing this package registers every mixer (see mixers/registry.py)."""
from mixerlab.mixers import (  # noqa: F401  (registration)
    deltanet, gated_deltanet, gdn2, gla, hgrn2, interdomain, kda, linear_attention, mamba2, muir, retnet, rwkv7,
    s4d, softmax_attention, vla)
