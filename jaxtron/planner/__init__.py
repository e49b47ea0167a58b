"""Choosing a parallel layout before running it: memory, communication and time per layout."""
