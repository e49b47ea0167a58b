"""Attention kernels behind one interface: `attention(q, k, v, causal=..., impl=...)`."""

from jaxtron.kernels.attention import AttentionImpl, attention

__all__ = ["AttentionImpl", "attention"]
