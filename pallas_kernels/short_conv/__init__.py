"""The causal depthwise short convolution with segment resets: reference, XLA custom VJP and a Pallas-Triton
kernel pair for the GPU. See api.py."""
from mixerlab.pallas_kernels.short_conv.api import causal_conv

__all__ = ["causal_conv"]
