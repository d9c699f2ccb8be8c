"""Causal softmax attention over packed documents: reference, dense XLA, splash (TPU) and flash (GPU) kernels."""
from mixerlab.pallas_kernels.attention.api import attention

__all__ = ["attention"]
