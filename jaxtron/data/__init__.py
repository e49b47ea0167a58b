"""Token datasets: the built-in corpus, Megatron-format indexed files, and the grain pipeline."""
