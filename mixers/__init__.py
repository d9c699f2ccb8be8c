"""Token mixers. Importing this package registers every mixer (see mixers/registry.py)."""
from mixers import deltanet, gated_deltanet, gdn2, kda, linear_attention, muir  # noqa: F401  (registration)

from mixers import softmax_attention  # noqa: F401,E402
