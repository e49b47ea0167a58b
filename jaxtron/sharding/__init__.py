"""Device mesh and the logical-axis rules that place parameters and activations on it.

Models name their axes logically (`embed`, `heads`, `mlp`, ...); `rules.py` maps those names to
the mesh axes built in `mesh.py`. Nothing else in jaxtron decides where an array lives.
`collectives.py` counts what a compiled program sends, `report.py` what a layout stores, and
`zigzag.py` the ring's sequence order.
"""
