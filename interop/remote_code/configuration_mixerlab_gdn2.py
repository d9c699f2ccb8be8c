"""GDN-2 config for HF transformers (written by mixerlab's export, loaded with ``trust_remote_code=True``).

fla 0.6.0 ships the layer ``fla.layers.GatedDeltaNet2`` but no GDN-2 model; the model reuses fla's KDA model
(the blocks are the same, only the token mixer differs), so the config is KDA's fields under its own
``model_type``. Imports only transformers and fla.
"""
from fla.models import KDAConfig


class GDN2Config(KDAConfig):
    model_type = "gdn2"

    # An __init__ of its own: transformers 5 gives a config subclass without one a dataclass __init__ that skips
    # KDAConfig's, and its fields (safe_gate, ...) would be left unset.
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
