"""jaxtron: Megatron-LM style hybrid parallel transformer training in JAX.

Entry points: `python -m jaxtron.train --config configs/tiny.yaml [section.key=value ...]` and
`python -m jaxtron.data.prepare`. For notebooks, `jaxtron.training.trainer.Trainer` builds the mesh,
state and jitted step from a config. Importing jaxtron changes nothing in the process (no XLA
flags, no allocator settings): the command-line entry points make those choices.
"""

__version__ = "0.1.0"
