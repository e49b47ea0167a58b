"""Hugging Face checkpoints: the families' names and defaults (`arch`), the tensor table
(`tensors`), RoPE settings (`rope`), directories on disk (`files`), and the translation between
a Hugging Face config and jaxtron's (`translate`)."""
