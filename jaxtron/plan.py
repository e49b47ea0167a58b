"""Pick a parallel layout: predicted memory, communication and step time of every legal one.

    python -m jaxtron.plan --config configs/llama3-70b.yaml --devices 256 --device-memory 80GiB \
        --hardware h100
    python -m jaxtron.plan --config configs/tiny.yaml --devices 8 --device-memory 1GiB \
        --hardware cpu --apply runs/planned.yaml          # then: jaxtron.train --config that
    python -m jaxtron.plan --config X --devices N --device-memory M \
        --compare "mesh.tensor=8 mesh.stage=8 pipeline.microbatches=64"   # rank a given layout

Prints the fastest layouts that fit (per-device memory by parameters, optimizer state,
gradients, activations and logits; bytes sent per device per step by axis; the pipeline bubble
and a rank's idle share with jobs at their lengths; step time and MFU from a roofline). How
each number is modelled: `jaxtron/planner/`.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from jaxtron.config.flags import above, at_least
from jaxtron.config.loading import dump_config, load_config, parse_override
from jaxtron.config.platforms import local_platform
from jaxtron.errors import ConfigError, exits_on_user_error
from jaxtron.planner.hardware import HARDWARE, Hardware
from jaxtron.planner.layout import Layout, apply
from jaxtron.planner.memory import memory_budget_bytes
from jaxtron.planner.search import Ranking, plan
from jaxtron.training.flops import cpu_peak

# Every config key a layout sets names the Layout field of the same name (mesh.tensor -> tensor).
LAYOUT_KEYS = {key: key.split(".")[1] for key in Layout(
    stage=2, sequence=2, context_parallel="hybrid").overrides()}


def parse_layout(text: str, devices: int) -> dict:
    """'mesh.tensor=8 mesh.stage=16 ...' -> the Layout fields it fixes; mesh degrees not given
    are 1 except mesh.data, which takes the devices left over."""
    fields = {}
    for item in text.replace(",", " ").split():
        key, value = parse_override(item)
        if key not in LAYOUT_KEYS:
            raise ConfigError(f"--compare key {key} is not a layout field; use "
                              f"{', '.join(LAYOUT_KEYS)}.")
        fields[LAYOUT_KEYS[key]] = value
    mesh = {axis: fields.get(axis, 1) for axis in ("fsdp", "tensor", "sequence", "expert",
                                                   "stage")}
    used = Layout(**mesh).devices
    fields.setdefault("data", devices // used)
    if used * fields["data"] != devices:
        raise ConfigError(f"--compare degrees multiply to {used * fields['data']}, not --devices "
                          f"{devices}; make them multiply to {devices}.")
    return {**mesh, **fields}


def size(n: float) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def format_row(index, candidate) -> str:
    mem, cost = candidate.memory, candidate.cost
    comm = ", ".join(f"{axis} {size(volume)}" for axis, volume in cost.comm_bytes.items()
                     if volume > 0) or "none"
    return (f"{index:>4}  {candidate.layout.describe():<52} {size(mem.total):>10} "
            f"(params {size(mem.params)}, optimizer {size(mem.optimizer)}, grads "
            f"{size(mem.gradients)}, activations {size(mem.activations)}, logits "
            f"{size(mem.logits)})  bubble {cost.bubble:.1%} (idle {cost.idle:.1%})  step "
            f"{cost.step_s:.4g} s  MFU {cost.mfu:.1%}  sent per device: {comm}")


def _check_flags(args) -> None:
    at_least("--devices", args.devices, 1, "give the device count to plan for, e.g. 64")
    at_least("--top", args.top, 1, "show at least one layout")
    at_least("--node-size", args.node_size, 1, "give the devices per node, e.g. 8")
    for flag in ("peak_tflops", "intra_bw", "inter_bw", "host_bw"):
        above(f"--{flag.replace('_', '-')}", getattr(args, flag), 0, "give a positive rate, or "
              "leave it out for the hardware's")
    above("--efficiency", args.efficiency, 0, "give the share of peak a step reaches, e.g. 0.5")
    if args.efficiency is not None and args.efficiency > 1:
        raise ConfigError(f"--efficiency {args.efficiency} is a share of the peak: give a value "
                          "of at most 1, e.g. 0.5.")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m jaxtron.plan",
                                     description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("--config", required=True)
    parser.add_argument("overrides", nargs="*", help="section.key=value overrides")
    parser.add_argument("--devices", type=int, required=True)
    parser.add_argument("--device-memory", help="per-device budget, e.g. 80GiB (default: the "
                        "hardware's memory)")
    parser.add_argument("--hardware", default="h100", choices=sorted(HARDWARE))
    parser.add_argument("--peak-tflops", type=float, help="override the peak bf16 TFLOP/s")
    parser.add_argument("--intra-bw", type=float, help="override intra-node GB/s per device")
    parser.add_argument("--inter-bw", type=float, help="override inter-node GB/s per device")
    parser.add_argument("--host-bw", type=float, help="override device-to-host GB/s per device "
                        "(what remat=offload moves over)")
    parser.add_argument("--node-size", type=int, help="override devices per node")
    parser.add_argument("--efficiency", type=float, help="override achieved share of peak")
    parser.add_argument("--platform", default=None, choices=("gpu", "cpu", "tpu"),
                        help="where the run will go: it decides which attention kernel "
                        "attention_impl=auto means, and so what remat=save_dots recomputes")
    parser.add_argument("--top", type=int, default=10)
    parser.add_argument("--apply", help="write the best layout into this config file")
    parser.add_argument("--compare", help="a given layout to rank, e.g. 'mesh.tensor=8 "
                        "mesh.stage=16 pipeline.microbatches=128'")
    return parser


def _hardware(args) -> Hardware:
    """The named hardware with the flags' overrides; on simulated CPU devices, this machine's
    rate (measured, or $JAXTRON_CPU_PEAK_FLOPS) shared between them."""
    hardware = HARDWARE[args.hardware]
    if hardware.shared_cores and args.peak_tflops is None and local_platform() == "cpu":
        hardware = dataclasses.replace(hardware, peak_flops=cpu_peak()[0] / args.devices)
    scaled = lambda value, unit: None if value is None else value * unit  # noqa: E731
    changes = {"peak_flops": scaled(args.peak_tflops, 1e12),
               "intra_bw": scaled(args.intra_bw, 1e9), "inter_bw": scaled(args.inter_bw, 1e9),
               "host_bw": scaled(args.host_bw, 1e9),
               "node_size": args.node_size, "efficiency": args.efficiency}
    return dataclasses.replace(hardware, **{k: v for k, v in changes.items() if v is not None})


def _print_ranking(ranked: Ranking, best: list, args, hardware: Hardware, budget: int):
    """The search's summary line, the best layouts, and where `--compare`'s layout ranks."""
    fitting = len(ranked.fitting)
    print(f"{ranked.considered} layouts of {args.devices} x {hardware.name} considered, "
          f"{fitting} fit in {size(budget)} per device; peak {hardware.peak_flops / 1e12:.4g} "
          f"TFLOP/s x efficiency {hardware.efficiency}, links {hardware.intra_bw / 1e9:.0f} / "
          f"{hardware.inter_bw / 1e9:.0f} GB/s inside / across nodes of {hardware.node_size}")
    for i, candidate in enumerate(best, 1):
        print(format_row(i, candidate))
    if args.compare:
        position, mine = ranked.position_of(parse_layout(args.compare, args.devices))
        if mine is None:
            print(f"given layout ({args.compare}): no variant fits {size(budget)} per device")
        else:
            print(f"given layout ({args.compare}), best variant ranks {position} of {fitting}:")
            print(format_row(position, mine))


@exits_on_user_error
def main(argv=None) -> int:
    args = _parser().parse_intermixed_args(argv)
    config = load_config(args.config, args.overrides)
    _check_flags(args)
    hardware = _hardware(args)
    budget = (memory_budget_bytes(args.device_memory) if args.device_memory
              else hardware.memory_bytes)
    platform = args.platform or ("cpu" if hardware.name == "cpu" else "gpu")
    ranked = plan(config, args.devices, hardware, budget, platform)
    if not ranked.considered:
        raise ConfigError(
            f"--devices {args.devices} admits no layout of this model: the mesh degrees must "
            f"multiply to {args.devices} and split train.batch_size="
            f"{config.train.batch_size}, the heads, the MLP and the vocabulary evenly; choose "
            "a device count that does, or raise train.batch_size.")
    best = ranked.best(config, args.top)
    _print_ranking(ranked, best, args, hardware, budget)
    if not best:
        raise ConfigError(f"no layout of {config.model.num_layers}-layer d_model "
                          f"{config.model.d_model} fits {size(budget)} on "
                          f"{args.devices} devices; raise --device-memory or --devices, lower "
                          "train.batch_size, or set model.cross_entropy=chunked.")
    if args.apply:
        planned = with_own_run_dir(apply(config, best[0].layout), Path(args.apply))
        Path(args.apply).parent.mkdir(parents=True, exist_ok=True)
        Path(args.apply).write_text(dump_config(planned))
        print(f"wrote {args.apply} (train.run_dir={planned.train.run_dir}): python -m "
              f"jaxtron.train --config {args.apply}")
    return 0


def with_own_run_dir(config, written: Path):
    """The planned config trains in a folder named after the file it is written to, so that it
    never resumes the run it was planned from (which would start at that run's last step)."""
    run_dir = written.with_suffix("")
    if (run_dir / "config.yaml").exists() or (run_dir / "checkpoints").exists():
        raise ConfigError(f"--apply {written} would train in {run_dir}, which holds a run; "
                          "give --apply another file name, or move that run away.")
    return dataclasses.replace(config, train=dataclasses.replace(config.train,
                                                                  run_dir=str(run_dir)))


if __name__ == "__main__":
    sys.exit(main())
