"""Grouped-matmul throughput: the experts' `ragged_dot` against a dense batched matmul of the
same FLOPs, side by side in one run.

    python -m jaxtron.kernels.grouped_speed                       # GPU: DeepSeek-V3-sized experts
    python -m jaxtron.kernels.grouped_speed --rows 512 --d-model 64 --ffn 32 --experts 4  # CPU

The grouped matmul is what a dropless MoE layer runs per FFN matrix (`kernels/fp8.py`
`grouped_matmul`: `ragged_dot` over rows sorted by expert). The yardstick is the same work as
an [E, rows/E, D] x [E, D, F] batched matmul, what equal groups would allow: the ratio says
what the ragged form costs over it. Rows are split over the experts unevenly (a fixed skew), as
routing leaves them. Each is compiled, warmed up, then timed as `--iters` back-to-back calls
ended by one `block_until_ready`; the best of `--repeats` is reported.
"""

from __future__ import annotations

import argparse
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

from jaxtron.kernels.fp8 import grouped_matmul
from jaxtron.kernels.speed import seconds_per_call

DTYPES = {"bf16": jnp.bfloat16, "fp32": jnp.float32}


def group_sizes(rows: int, experts: int, skew: float = 2.0) -> np.ndarray:
    """Rows per expert falling linearly from `skew` to 1 (relative), summing to `rows`."""
    weights = np.linspace(skew, 1.0, experts)
    sizes = np.floor(rows * weights / weights.sum()).astype(np.int32)
    sizes[0] += rows - sizes.sum()
    return sizes


def measure(rows: int, d_model: int, ffn: int, experts: int, dtype: str = "bf16",
            iters: int = 10, repeats: int = 3) -> dict:
    """TFLOP/s of the grouped and the dense batched matmul, and their ratio."""
    dt = DTYPES[dtype]
    keys = jax.random.split(jax.random.key(0), 2)
    x = jax.random.normal(keys[0], (1, rows, d_model), dt)
    w = jax.random.normal(keys[1], (experts, d_model, ffn), dt) / np.sqrt(d_model)
    sizes = jnp.asarray(group_sizes(rows, experts))[None]
    grouped = jax.jit(lambda x, w, s: grouped_matmul(x, w, s))
    even = x.reshape(experts, rows // experts, d_model)
    dense = jax.jit(lambda x, w: jnp.einsum("egd,edf->egf", x, w))
    flops = 2.0 * rows * d_model * ffn
    grouped_s = seconds_per_call(grouped, (x, w, sizes), warmup=1, iters=iters, repeats=repeats)
    dense_s = seconds_per_call(dense, (even, w), warmup=1, iters=iters, repeats=repeats)
    return {"rows": rows, "d_model": d_model, "ffn": ffn, "experts": experts, "dtype": dtype,
            "device": jax.devices()[0].device_kind, "flops": flops,
            "grouped_tflops": flops / grouped_s / 1e12, "dense_tflops": flops / dense_s / 1e12,
            "grouped_ms": grouped_s * 1e3, "dense_ms": dense_s * 1e3,
            "grouped_over_dense_time": grouped_s / dense_s}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jaxtron.kernels.grouped_speed",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=32768,
                        help="rows (token assignments) a rank runs through its experts")
    parser.add_argument("--d-model", type=int, default=7168)
    parser.add_argument("--ffn", type=int, default=2048, help="each expert's hidden width")
    parser.add_argument("--experts", type=int, default=4, help="experts on this rank")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", action="store_true", help="also print the result as JSON")
    args = parser.parse_args(argv)
    for flag, value in (("--rows", args.rows), ("--d-model", args.d_model), ("--ffn", args.ffn),
                        ("--experts", args.experts), ("--iters", args.iters),
                        ("--repeats", args.repeats)):
        if value < 1:
            parser.error(f"{flag} {value} must be at least 1")
    if args.rows % args.experts:
        parser.error(f"--rows {args.rows} must be a multiple of --experts {args.experts} "
                     "(the dense yardstick splits them evenly)")
    r = measure(args.rows, args.d_model, args.ffn, args.experts, args.dtype, args.iters,
                args.repeats)
    print(f"{r['device']}, {r['dtype']}: {r['rows']} rows x {r['d_model']} -> {r['ffn']} over "
          f"{r['experts']} experts: grouped (ragged_dot) {r['grouped_tflops']:.2f} TFLOP/s "
          f"({r['grouped_ms']:.3f} ms), dense batched {r['dense_tflops']:.2f} TFLOP/s "
          f"({r['dense_ms']:.3f} ms); grouped/dense time {r['grouped_over_dense_time']:.3f}")
    if args.json:
        print(json.dumps(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
