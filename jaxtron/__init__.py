"""jaxtron: Megatron-LM style hybrid parallel transformer training in JAX.

Entry points: `python -m jaxtron.train --config configs/tiny.yaml [section.key=value ...]` and
`python -m jaxtron.data.prepare`. For notebooks, `jaxtron.train.Trainer` builds the mesh, state
and jitted step from a config.
"""

__version__ = "0.1.0"

from jaxtron.host_memory import keep_freed_host_memory

HOST_MEMORY_KEPT = keep_freed_host_memory()
