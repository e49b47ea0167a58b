"""What a layout costs, before running it: the parameter sharding table and per-device memory.

Per-device bytes of parameters and optimizer state are read off each array's shard shape; peak
temporaries come from XLA's memory analysis of the compiled step.
"""

from __future__ import annotations

import math

import jax
import numpy as np
from flax import nnx

from jaxtron.sharding.rules import logical_names


def shard_bytes(tree) -> int:
    """Bytes one device holds of `tree` (arrays or ShapeDtypeStructs with shardings)."""
    total = 0
    for leaf in jax.tree.leaves(tree):
        shape = leaf.sharding.shard_shape(leaf.shape)
        total += math.prod(shape) * np.dtype(leaf.dtype).itemsize
    return total


def parameter_table(abstract_params) -> str:
    rows = [("parameter", "shape", "logical axes", "mesh spec", "per-device")]
    for path, var in nnx.to_flat_state(abstract_params):
        value = var.get_value()
        spec = value.sharding.spec
        rows.append(("/".join(map(str, path)), "x".join(map(str, value.shape)),
                     ",".join(str(n) for n in logical_names(var)),
                     str(tuple(spec)), _mib(shard_bytes(value))))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def _mib(n: int) -> str:
    return f"{n / 2**20:.3f} MiB"


def memory_report(abstract_state, compiled) -> dict:
    stats = compiled.memory_analysis()
    return {"params_bytes": shard_bytes(abstract_state.params),
            "optimizer_bytes": shard_bytes(abstract_state.opt_state),
            "temp_bytes": int(stats.temp_size_in_bytes),
            "argument_bytes": int(stats.argument_size_in_bytes),
            "output_bytes": int(stats.output_size_in_bytes),
            "alias_bytes": int(stats.alias_size_in_bytes)}


def format_memory(report: dict) -> str:
    return (f"per-device memory: parameters {_mib(report['params_bytes'])}, optimizer state "
            f"{_mib(report['optimizer_bytes'])}, peak temporaries {_mib(report['temp_bytes'])} "
            f"(step arguments {_mib(report['argument_bytes'])}, donated "
            f"{_mib(report['alias_bytes'])})")
