"""Decoder-only transformers in Flax NNX: pure math, logical axis names, no mesh.

Shape suffixes in names use one letter per dimension:
    B batch        L sequence (queries)   S sequence (keys)   D d_model
    H query heads  G kv heads             R query heads per kv head (H = G * R)
    K head dim     F mlp hidden           V vocabulary        N layers
so `q_BxLxHxK` is a query tensor of shape [batch, seq, heads, head_dim].
"""
