"""Attention kernels behind one entry point (`attention.attention`), chosen by one decision table
(`choice.py`); fp8 matmuls, the expert feed-forward under expert parallelism, activations whose
backward keeps only their inputs, and the fused cross-entropy."""
