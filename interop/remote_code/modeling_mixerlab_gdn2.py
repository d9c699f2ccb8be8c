"""GDN-2 causal LM for HF transformers (written by mixerlab's export, loaded with ``trust_remote_code=True``):
fla's KDA model with ``fla.layers.GatedDeltaNet2`` as the token mixer of every block that is not one of the
config's softmax ``attn`` layers. The tensor names are the KDA model's. Imports only torch, transformers and fla.
"""
from fla.layers import GatedDeltaNet2, KimiDeltaAttention
from fla.models import KDAForCausalLM, KDAModel

from .configuration_mixerlab_gdn2 import GDN2Config


def _use_gdn2_layers(model, config) -> None:
    """Replaces the KDA layer of each block (not the softmax ``attn`` layers) by a GatedDeltaNet2 layer."""
    for i, block in enumerate(model.layers):
        if isinstance(block.attn, KimiDeltaAttention):
            block.attn = GatedDeltaNet2(hidden_size=config.hidden_size, expand_v=config.expand_v,
                                        head_dim=config.head_dim, num_heads=config.num_heads,
                                        use_short_conv=config.use_short_conv,
                                        allow_neg_eigval=config.allow_neg_eigval, conv_size=config.conv_size,
                                        norm_eps=config.norm_eps, layer_idx=i)


class GDN2Model(KDAModel):
    config_class = GDN2Config

    def __init__(self, config: GDN2Config):
        super().__init__(config)
        _use_gdn2_layers(self, config)
        self.post_init()  # initialises the new layers' weights (the others are marked initialised already)


class GDN2ForCausalLM(KDAForCausalLM):
    config_class = GDN2Config

    def __init__(self, config: GDN2Config):
        super().__init__(config)
        _use_gdn2_layers(self.model, config)
        self.post_init()
