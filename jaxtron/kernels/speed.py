"""Attention throughput per implementation: TFLOP/s of the forward and of forward + backward.

    python -m jaxtron.kernels.speed                          # GPU: 1k..32k tokens, all impls
    python -m jaxtron.kernels.speed --seq-lens 4096 --kv-heads 4 --json
    python -m jaxtron.kernels.speed --seq-lens 128,256 --impls xla,pallas   # CPU smoke test

Each (implementation, sequence length, pass) is compiled, run `--warmup` times, then timed as
`--iters` back-to-back calls ended by one `block_until_ready` (so host dispatch overlaps device
work, as in training); the best of `--repeats` such runs is reported. FLOPs follow the
FlashAttention benchmark (Dao 2023): the q.k and p.v matmuls, 4 * B * H * L * L * K, halved when
causal. An implementation that is unavailable here (cuDNN off an NVIDIA GPU) is skipped with a
note; one that fails at a size (the XLA reference holds the [B, H, L, L] logits and runs out of
memory at long sequences) is reported as failed at that size and the sweep goes on.

Implementations: `xla`, `cudnn` and `pallas` are jaxtron's (`model.attention_impl`); `pallas`
is Triton on a GPU. `jax-triton` is JAX's own Pallas/Triton attention
(`jax.experimental.pallas.ops.gpu.attention.mha`), the yardstick for a hand-written Triton
kernel; it has no grouped-query form, so its k and v are repeated to every query head first
(that copy is timed with it). It runs on GPUs only.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import jax
import jax.numpy as jnp

from jaxtron.config.platforms import local_platform
from jaxtron.kernels.attention import attention

IMPLS = ("xla", "cudnn", "pallas", "jax-triton")
MODES = ("fwd", "fwd+bwd")
DTYPES = {"bf16": jnp.bfloat16, "fp16": jnp.float16, "fp32": jnp.float32}
DEFAULT_SEQ_LENS = tuple(2 ** n for n in range(10, 16))  # 1024 .. 32768


def attention_flops(batch: int, heads: int, seq_len: int, head_dim: int, causal: bool,
                    mode: str) -> float:
    """Matmul FLOPs of one pass, the FlashAttention benchmark's convention.

    Forward: q k^T and p v, 2 * B * H * L * L * K each; causal attention does half the work.
    Backward: 2.5x the forward, its five matmuls (the recomputed q k^T, then dv, dp, dq, dk)
    against the forward's two; forward + backward is therefore 1 + 2.5 = 3.5x the forward.
    """
    forward = 4 * batch * heads * seq_len * seq_len * head_dim / (2 if causal else 1)
    return forward if mode == "fwd" else 3.5 * forward


def unavailable(impl: str) -> str | None:
    """Why `impl` cannot run on this backend, or None."""
    platform = local_platform()
    if impl == "cudnn" and platform != "cuda":
        return f"cudnn skipped: needs an NVIDIA GPU, the backend is {platform}"
    if impl == "jax-triton" and platform not in ("cuda", "rocm"):
        return f"jax-triton skipped: needs a GPU, the backend is {platform}"
    return None


def jax_triton_attention(q, k, v, *, causal: bool):
    """JAX's Pallas/Triton flash attention, k and v repeated to every query head."""
    from jax.experimental.pallas.ops.gpu.attention import mha

    repeat = q.shape[2] // k.shape[2]
    k, v = (jnp.repeat(x, repeat, axis=2) for x in (k, v))
    return mha(q, k, v, None, sm_scale=q.shape[-1] ** -0.5, causal=causal)


def passes(impl: str, causal: bool) -> dict:
    """Jitted forward and forward + backward of one implementation."""
    def forward(q, k, v):
        if impl == "jax-triton":
            return jax_triton_attention(q, k, v, causal=causal)
        return attention(q, k, v, causal=causal, impl=impl)

    def forward_backward(q, k, v, d_out):
        _, vjp = jax.vjp(forward, q, k, v)
        return vjp(d_out)  # (dq, dk, dv): the backward needs the forward's residuals

    return {"fwd": jax.jit(forward), "fwd+bwd": jax.jit(forward_backward)}


def seconds_per_call(fn, args, *, warmup: int, iters: int, repeats: int) -> float:
    for _ in range(warmup):  # the first call compiles
        jax.block_until_ready(fn(*args))
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(iters):
            out = fn(*args)
        jax.block_until_ready(out)
        best = min(best, (time.perf_counter() - start) / iters)
    return best


def inputs(args, seq_len: int):
    dtype = DTYPES[args.dtype]
    ks = jax.random.split(jax.random.key(0), 4)
    q_shape = (args.batch, seq_len, args.heads, args.head_dim)
    kv_shape = (args.batch, seq_len, args.kv_heads, args.head_dim)
    return tuple(jax.random.normal(key, shape, dtype) for key, shape in
                 zip(ks, (q_shape, kv_shape, kv_shape, q_shape)))


def run(args) -> dict:
    """Every (length, pass, impl) cell: results, failures and skip notes."""
    impls = [impl for impl in args.impls if not unavailable(impl)]
    notes = [unavailable(impl) for impl in args.impls if unavailable(impl)]
    if "pallas" in impls and local_platform() not in ("cuda", "rocm"):
        notes.append("pallas runs in interpret mode off a GPU: its numbers say nothing about "
                     "kernel speed")
    fns = {impl: passes(impl, args.causal) for impl in impls}
    results = []
    for seq_len in args.seq_lens:
        q, k, v, d_out = inputs(args, seq_len)
        for mode in MODES:
            flops = attention_flops(args.batch, args.heads, seq_len, args.head_dim,
                                    args.causal, mode)
            for impl in impls:
                call_args = (q, k, v) if mode == "fwd" else (q, k, v, d_out)
                row = {"seq_len": seq_len, "mode": mode, "impl": impl, "flops": flops}
                try:
                    seconds = seconds_per_call(fns[impl][mode], call_args, warmup=args.warmup,
                                               iters=args.iters, repeats=args.repeats)
                    row.update(ms=seconds * 1e3, tflops=flops / seconds / 1e12)
                except Exception as err:  # out of memory, unsupported shape: report, go on
                    row.update(ms=None, tflops=None,
                               error=f"{type(err).__name__}: {str(err).splitlines()[0][:160]}")
                results.append(row)
                print(f"  {impl:>6} {mode:<7} L={seq_len:<6} "
                      + (f"{_fmt(row['tflops']):>8} TFLOP/s" if row["tflops"] is not None
                         else f"failed ({row['error']})"), file=sys.stderr, flush=True)
    return {"impls": impls, "results": results, "notes": notes}


def _fmt(tflops: float) -> str:
    # Three significant digits: hundreds of TFLOP/s on a GPU, thousandths in CPU interpret mode.
    return f"{tflops:.3g}"


def table(report: dict) -> str:
    """TFLOP/s per impl for each (length, pass), with pallas's ratios to the others."""
    impls = report["impls"]
    tflops = {(r["seq_len"], r["mode"], r["impl"]): r["tflops"] for r in report["results"]}
    ratios = [other for other in ("cudnn", "jax-triton", "xla")
              if other in impls and "pallas" in impls]
    header = ["seq_len", "pass", *[f"{impl} TFLOP/s" for impl in impls],
              *[f"pallas/{other}" for other in ratios]]
    rows = []
    for seq_len in dict.fromkeys(r["seq_len"] for r in report["results"]):
        for mode in MODES:
            cells = [tflops.get((seq_len, mode, impl)) for impl in impls]
            row = [str(seq_len), mode, *[_fmt(c) if c is not None else "failed"
                                         for c in cells]]
            for other in ratios:
                mine, theirs = tflops.get((seq_len, mode, "pallas")), tflops.get(
                    (seq_len, mode, other))
                row.append(f"{mine / theirs:.2f}x" if mine and theirs else "-")
            rows.append(row)
    widths = [max(len(line[i]) for line in [header, *rows]) for i in range(len(header))]
    return "\n".join("  ".join(cell.rjust(w) for cell, w in zip(line, widths))
                     for line in [header, *rows])


def _csv(kind):
    return lambda text: tuple(kind(item) for item in text.split(",") if item)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m jaxtron.kernels.speed",
                                description="Attention TFLOP/s per implementation.")
    p.add_argument("--seq-lens", type=_csv(int), default=DEFAULT_SEQ_LENS,
                   help="comma-separated sequence lengths (default 1024..32768)")
    p.add_argument("--impls", type=_csv(str), default=IMPLS,
                   help=f"comma-separated subset of {','.join(IMPLS)}")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=16)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", choices=DTYPES, default="bf16")
    p.add_argument("--causal", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--warmup", type=int, default=2, help="untimed calls (the first compiles)")
    p.add_argument("--iters", type=int, default=10, help="timed calls per repeat")
    p.add_argument("--repeats", type=int, default=3, help="timed runs; the best is reported")
    p.add_argument("--json", action="store_true", help="end with one JSON line of all results")
    return p


def main(argv=None) -> int:
    p = parser()
    args = p.parse_args(argv)
    unknown = [impl for impl in args.impls if impl not in IMPLS]
    if unknown:
        p.error(f"unknown --impls {unknown}; choose from {','.join(IMPLS)}")
    if args.heads % args.kv_heads:
        p.error(f"--kv-heads {args.kv_heads} must divide --heads {args.heads}")
    device = jax.devices()[0].device_kind
    causal = "causal" if args.causal else "full"
    print(f"attention on {device} ({local_platform()}): {args.dtype}, batch {args.batch}, "
          f"heads {args.heads} (kv {args.kv_heads}), head_dim {args.head_dim}, {causal}; "
          f"best of {args.repeats} x {args.iters} calls")
    report = run(args)
    print(table(report))
    for note in report["notes"]:
        print(f"note: {note}")
    for row in report["results"]:
        if "error" in row:
            print(f"note: {row['impl']} {row['mode']} at {row['seq_len']} failed: {row['error']}")
    print("FLOPs: 4*B*H*L*L*K forward (halved when causal); fwd+bwd 3.5x that (backward 2.5x).")
    if args.json:
        config = {key: getattr(args, key) for key in
                  ("batch", "heads", "kv_heads", "head_dim", "dtype", "causal", "seq_lens")}
        print(json.dumps({"device": device, "backend": local_platform(), "config": config,
                          **report}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
