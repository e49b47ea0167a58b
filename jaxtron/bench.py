"""Training-step benchmark: tokens/s, TFLOP/s per device, MFU and HFU, compile time, memory.

    python -m jaxtron.bench --config configs/tiny.yaml
    python -m jaxtron.bench --config configs/llama3-8b.yaml model.num_layers=4 mesh.tensor=1 --json

The step is the one `jaxtron.train` runs (same Trainer, same jit), fed random tokens so no data
is read. After `--warmup` steps, `--repeats` windows of `--steps` back-to-back steps are timed,
each closed by one `block_until_ready`, and the median window gives the step time.

- MFU: model FLOPs (`jaxtron.training.flops`, the formula training reports) / step time / peak.
- HFU: the same plus the FLOPs that activation recompute repeats (`model.remat: full` runs every
  block's forward twice; `save_dots` the attention forward, with cuDNN only).
- Peak: datasheet bf16 numbers for known accelerators; on CPU, an fp32 matmul measured in this
  run on the whole machine (simulated devices share its cores).
- Overhead: on one device, the jaxtron step against `jaxtron.training.plain_llama`, the same model written
  as a minimal plain-JAX step; their ratio is what the framework costs (Llama models only).

`--compare-fp8` also times the same step with `model.fp8: tensorwise` and with `none`, side
by side in this run, and prints their step-time ratio (on CPU XLA emulates fp8 in wider types,
so the ratio there measures the quantisation's overhead, not fp8 tensor cores).

`--compare-schedules 1f1b,zb-h1,zbv,interleaved,gpipe` times the step of a pipelined config
once per pipeline schedule (same model, mesh and microbatches; `interleaved` with two chunks
per rank unless the config sets more, `zbv` with two), side by side in this run, and prints
each one's step time, its ratio to the first and the bubble of its tick table; `1f1b:stored`
runs a schedule without recomputation (`pipeline.recompute=false`). On simulated CPU devices the
ranks share the machine's cores, so an idle rank frees them for the others: the measured ratios
there show total work and the schedules' other costs (more ticks, more sends), not their
bubbles. Beside them each row prints the ratio its table gives where ranks run side by side,
jobs at their real lengths (`pipeline/timeline.py`): a model, not a measurement.

`--json` prints one JSON object with every number as the last line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import jax
import numpy as np

from jaxtron.config.flags import at_least
from jaxtron.config.loading import (
    config_from_dict,
    config_to_dict,
    load_config,
    single_device_config,
)
from jaxtron.config.schema import Config
from jaxtron.data.windows import batch_keys
from jaxtron.errors import ConfigError, exits_on_user_error
from jaxtron.pipeline.schedules import build_table
from jaxtron.pipeline.timeline import step_units, weighted_idle
from jaxtron.planner import schedule_choice
from jaxtron.runtime.cpu_matmuls import compiler_options
from jaxtron.runtime.host_memory import keep_freed_host_memory
from jaxtron.sharding.mesh import describe_mesh
from jaxtron.sharding.report import memory_report
from jaxtron.training import plain_llama
from jaxtron.training.flops import hardware_flops_per_token, peak_flops, training_flops_per_token
from jaxtron.training.trainer import Trainer

FIELDS = ("tokens_per_s", "step_s", "model_tflops_per_device", "mfu", "hfu", "compile_s",
          "params_bytes_per_device", "optimizer_bytes_per_device", "temp_bytes_per_device",
          "peak_flops", "peak_source", "devices", "mesh", "flops_per_token",
          "hardware_flops_per_token", "plain_tokens_per_s", "jaxtron_one_device_tokens_per_s",
          "overhead_ratio")


def random_tokens(config: Config, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    shape = (config.train.batch_size, config.data.seq_len + 1)
    return rng.integers(0, config.model.vocab_size, shape, dtype=np.int32)


def random_batch(config) -> dict:
    """A batch with every key the config's data has (`windows.batch_keys`): random tokens,
    and for packed rows four documents per row, every target counted."""

    batch = {"tokens": random_tokens(config)}
    rows, length = config.train.batch_size, config.data.seq_len
    keys = batch_keys(config)
    if "segment_ids" in keys:
        segment = np.minimum(np.arange(length) * 4 // length, 3) + 1
        batch["segment_ids"] = np.broadcast_to(segment, (rows, length)).astype(np.int32)
        starts = np.searchsorted(segment, segment, side="left")
        batch["positions"] = np.broadcast_to(np.arange(length) - starts,
                                             (rows, length)).astype(np.int32)
    if "loss_mask" in keys:
        batch["loss_mask"] = np.ones((rows, length), np.float32)
    return batch


def time_steps(step, state, batch, warmup: int, steps: int, repeats: int):
    """Median seconds per step over `repeats` windows; returns (seconds, final state)."""
    for _ in range(warmup):
        state, out = step(state, batch)
    jax.block_until_ready(state)
    windows = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(steps):
            state, out = step(state, batch)
        jax.block_until_ready((state, out))
        windows.append((time.perf_counter() - start) / steps)
    return statistics.median(windows), state


def bench_jaxtron(config, devices, warmup, steps, repeats) -> dict:

    trainer = Trainer(config, devices)
    state = trainer.init_state()
    batch = trainer.put_batch(random_batch(config))
    start = time.perf_counter()
    compiled = trainer.compile_step(state, batch)
    compile_s = time.perf_counter() - start
    memory = memory_report(trainer.abstract_state(), compiled)
    step_s, _ = time_steps(compiled, state, batch, warmup, steps, repeats)
    return {"step_s": step_s, "compile_s": compile_s, "memory": memory,
            "mesh": describe_mesh(trainer.mesh, config.mesh)}


def measured_once(config, devices, warmup, steps, repeats, measured: dict | None) -> dict:
    """`bench_jaxtron`, measured once per config, devices and timing settings in this run
    (`measured` holds them): a comparison's row that is the run's own config is the run's
    measurement, not a second compile of the same step."""
    if measured is None:
        return bench_jaxtron(config, devices, warmup, steps, repeats)
    key = repr((config, [d.id for d in devices], warmup, steps, repeats))
    if key not in measured:
        measured[key] = bench_jaxtron(config, devices, warmup, steps, repeats)
    return measured[key]


def bench_plain(config, device, warmup, steps, repeats) -> float:
    init_state, step = plain_llama.make_step(config, compiler_options([device]))
    with jax.default_device(device):
        state = init_state()
        tokens = jax.device_put(random_tokens(config), device)
        step_s, _ = time_steps(step, state, tokens, warmup, steps, repeats)
    return step_s


def run(config: Config, warmup: int = 3, steps: int = 5, repeats: int = 3,
        reference: bool = True, measured: dict | None = None) -> dict:
    devices = jax.devices()
    tokens = config.train.batch_size * config.data.seq_len
    flops = training_flops_per_token(config.model, config.data.seq_len, config.moe)
    hw_flops = hardware_flops_per_token(config)
    main = measured_once(config, devices, warmup, steps, repeats, measured)
    peak, source = peak_flops(devices)
    step_s = main["step_s"]
    report = {
        "tokens_per_s": tokens / step_s, "step_s": step_s,
        "model_tflops_per_device": flops * tokens / step_s / len(devices) / 1e12,
        "mfu": flops * tokens / step_s / peak, "hfu": hw_flops * tokens / step_s / peak,
        "compile_s": main["compile_s"],
        "params_bytes_per_device": main["memory"]["params_bytes"],
        "optimizer_bytes_per_device": main["memory"]["optimizer_bytes"],
        "temp_bytes_per_device": main["memory"]["temp_bytes"],
        "peak_flops": peak, "peak_source": source, "devices": len(devices),
        "mesh": main["mesh"], "flops_per_token": flops, "hardware_flops_per_token": hw_flops,
        "plain_tokens_per_s": None, "jaxtron_one_device_tokens_per_s": None,
        "overhead_ratio": None,
    }
    if reference and config.model.type == "llama" and not config.moe.enabled:
        single = single_device_config(config)
        ours = bench_jaxtron(single, devices[:1], warmup, steps, repeats)["step_s"]
        plain = bench_plain(single, devices[0], warmup, steps, repeats)
        report.update(plain_tokens_per_s=tokens / plain,
                      jaxtron_one_device_tokens_per_s=tokens / ours, overhead_ratio=ours / plain)
    return report


def compare_fp8(config: Config, warmup: int, steps: int, repeats: int,
                measured: dict | None = None) -> dict:
    """Step time with and without fp8 matmuls, measured one after the other in this run."""
    devices, times = jax.devices(), {}
    for mode in ("none", "tensorwise"):
        variant = config_from_dict(config_to_dict(config), [f"model.fp8={mode}"])
        times[mode] = measured_once(variant, devices, warmup, steps, repeats,
                                    measured)["step_s"]
    return {"step_s_no_fp8": times["none"], "step_s_fp8": times["tensorwise"],
            "fp8_step_time_ratio": times["tensorwise"] / times["none"]}


def compare_schedules(config: Config, schedules: list[str], warmup: int,
                      steps: int, repeats: int, measured: dict | None = None) -> dict:
    """Step time and tick-table bubble of each pipeline schedule, measured one after the
    other in this run, and the step the table would take where ranks run side by side
    (`pipeline/timeline.py`), relative to the first. `name:stored` runs a schedule with
    `pipeline.recompute=false`, `name:recompute` with true. The row that is the run's own
    config is the run's measurement (`measured_once`)."""

    p, pp = config.mesh.stage, config.pipeline
    if p <= 1:
        raise ConfigError("--compare-schedules needs a pipelined config: set "
                          "mesh.stage > 1 (and pipeline.microbatches).")
    rows = {}
    for entry in schedules:
        schedule, _, mode = entry.partition(":")
        if mode not in ("", "stored", "recompute"):
            raise ConfigError(f"--compare-schedules entry {entry!r}: use a schedule "
                              "name, optionally with ':stored' or ':recompute' (e.g. "
                              "zb-h1:stored).")
        recompute = pp.recompute if not mode else mode == "recompute"
        v = (max(pp.virtual_stages, 2) if schedule == "interleaved"
             else 2 if schedule == "zbv" else 1)
        variant = config_from_dict(config_to_dict(config), [
            f"pipeline.schedule={schedule}", f"pipeline.virtual_stages={v}",
            f"pipeline.recompute={str(recompute).lower()}"])
        step_s = measured_once(variant, jax.devices(), warmup, steps, repeats,
                               measured)["step_s"]
        table = build_table(schedule, p, pp.microbatches, v, recompute)
        rows[entry] = {"step_s": step_s, "virtual_stages": v, "recompute": recompute,
                       "bubble": table.bubble, "parallel_units": step_units(table, recompute),
                       "parallel_idle": weighted_idle(table, recompute)}
    first = rows[schedules[0]]
    for row in rows.values():
        row["step_time_ratio"] = row["step_s"] / first["step_s"]
        row["parallel_ratio"] = row["parallel_units"] / first["parallel_units"]
    return {"schedules": rows}


def format_report(r: dict) -> str:
    mib = 2 ** 20
    lines = [f"mesh {r['mesh']}; peak {r['peak_flops'] / 1e12:.3f} TFLOP/s ({r['peak_source']})",
             f"step {1e3 * r['step_s']:.1f} ms | {r['tokens_per_s']:,.0f} tok/s | "
             f"{r['model_tflops_per_device']:.4f} TFLOP/s per device | MFU "
             f"{100 * r['mfu']:.2f}% | HFU {100 * r['hfu']:.2f}% | compile {r['compile_s']:.1f} s",
             f"per device: parameters {r['params_bytes_per_device'] / mib:.2f} MiB, optimizer "
             f"{r['optimizer_bytes_per_device'] / mib:.2f} MiB, temporaries "
             f"{r['temp_bytes_per_device'] / mib:.2f} MiB"]
    if r["overhead_ratio"] is not None:
        lines.append(f"one device: jaxtron {r['jaxtron_one_device_tokens_per_s']:,.0f} tok/s, "
                     f"plain JAX {r['plain_tokens_per_s']:,.0f} tok/s, jaxtron/plain step time "
                     f"{r['overhead_ratio']:.3f}")
    else:
        lines.append("one device: no plain-JAX reference for this model (Llama dense only)")
    if r.get("fp8_step_time_ratio") is not None:
        lines.append(f"fp8 (tensorwise) step {1e3 * r['step_s_fp8']:.1f} ms vs "
                     f"{1e3 * r['step_s_no_fp8']:.1f} ms without: ratio "
                     f"{r['fp8_step_time_ratio']:.3f}")
    for name, row in r.get("schedules", {}).items():
        lines.append(f"schedule {name:<16} (v={row['virtual_stages']}): step "
                     f"{1e3 * row['step_s']:.1f} ms, ratio {row['step_time_ratio']:.3f}, "
                     f"bubble {row['bubble']:.3f} | ranks side by side (model): ratio "
                     f"{row['parallel_ratio']:.3f}, idle {row['parallel_idle']:.3f}")
    return "\n".join(lines)


@exits_on_user_error
def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jaxtron.bench",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, help="YAML config, e.g. configs/tiny.yaml")
    parser.add_argument("overrides", nargs="*", help="section.key=value overrides")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5, help="steps per timed window")
    parser.add_argument("--repeats", type=int, default=3, help="timed windows (median)")
    parser.add_argument("--no-reference", action="store_true",
                        help="skip the one-device plain-JAX comparison")
    parser.add_argument("--compare-fp8", action="store_true",
                        help="also time the step with model.fp8=tensorwise and none")
    parser.add_argument("--compare-schedules", metavar="S1,S2,...",
                        help="time a pipelined config once per pipeline schedule")
    parser.add_argument("--json", action="store_true", help="last line: one JSON object")
    args = parser.parse_intermixed_args(argv)
    at_least("--warmup", args.warmup, 0, "give the untimed steps before timing, e.g. 3")
    at_least("--steps", args.steps, 1, "time at least one step per window")
    at_least("--repeats", args.repeats, 1, "time at least one window")
    keep_freed_host_memory()  # before JAX starts its threads
    config = load_config(args.config, args.overrides)
    config, chosen = schedule_choice.for_this_run(config)
    if chosen:
        print(chosen, flush=True)
    measured: dict = {}  # each config's step, compiled and timed once in this run
    report = run(config, args.warmup, args.steps, args.repeats, not args.no_reference, measured)
    if args.compare_fp8:
        report.update(compare_fp8(config, args.warmup, args.steps, args.repeats, measured))
    if args.compare_schedules:
        report.update(compare_schedules(config, args.compare_schedules.split(","), args.warmup,
                                        args.steps, args.repeats, measured))
    print(format_report(report), flush=True)
    if args.json:
        print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
