"""RMSNorm fused with the residual add that precedes it in every pre-norm block.

The torch reference is the layer's own :func:`minipd.layers.norm.add_rms_norm`, under the name the
backends share: ``(rms_norm(x + residual), x + residual)``.
"""

from minipd.layers.norm import add_rms_norm as add_rms_norm_torch

__all__ = ["add_rms_norm_torch"]
