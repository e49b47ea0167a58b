"""Train a transformer from one YAML config.

    python -m jaxtron.train --config configs/tiny.yaml [section.key=value ...]
    python -m jaxtron.train --config configs/llama3-8b.yaml --dry-run --target cuda --devices 8

Writes <train.run_dir>/config.yaml (the resolved config) and metrics.jsonl (one JSON object per
logged step: step, loss, lr, grad_norm, tokens_per_s, mfu, data_wait_s (seconds per step spent
waiting for the input pipeline), eval_loss where evaluated (and eval_loss/<source> for a blend),
and for mixture-of-experts models moe_balance, moe_z, moe_dropped, moe_max_load), shows
a progress line every `train.log_every` steps and ends with a one-line summary. The loop is
`jaxtron.training.loop`; `--dry-run` builds one step and reports what it will run
(`jaxtron.planner.dry_run`).
"""

from __future__ import annotations

import argparse
import sys

import jax

from jaxtron.config.checks import config_warnings
from jaxtron.config.flags import at_least
from jaxtron.config.loading import dump_config, format_field_reference, load_config
from jaxtron.config.platforms import PLATFORMS, simulate_cpu_devices
from jaxtron.errors import ConfigError, exit_command, exits_on_user_error
from jaxtron.planner import schedule_choice
from jaxtron.planner.dry_run import dry_run
from jaxtron.runtime import distributed
from jaxtron.runtime.host_memory import keep_freed_host_memory
from jaxtron.training.flops import given_cpu_peak
from jaxtron.training.loop import run_training


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m jaxtron.train", description="Train a transformer from a YAML config.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Config fields (key, type, default, meaning); set any in the YAML file or as an "
               "override\nsection.key=value, e.g. train.steps=50 model.num_layers=4:\n\n"
               + format_field_reference())
    parser.add_argument("--config", help="YAML config file, e.g. configs/tiny.yaml")
    parser.add_argument("--print-config", action="store_true",
                        help="print the resolved config and exit")
    parser.add_argument("--dry-run", action="store_true",
                        help="build one step from abstract shapes, print the mesh, attention "
                             "kernel, parameter shardings and per-device memory, and exit "
                             "without training")
    parser.add_argument("--target", choices=PLATFORMS,
                        help="with --dry-run: the platform to check for (default: this "
                             "machine's); another one is lowered, not compiled, so a GPU or "
                             "TPU config is checked on a CPU machine")
    parser.add_argument("--devices", type=int,
                        help="with --dry-run: build the mesh from this many simulated CPU "
                             "devices (must be the first use of JAX in the process)")
    parser.add_argument("overrides", nargs="*", help="section.key=value overrides")
    return parser


@exits_on_user_error
def main(argv=None) -> int:
    args = _parser().parse_intermixed_args(argv)
    keep_freed_host_memory()  # before JAX starts its threads
    config = load_config(args.config, args.overrides)
    given_cpu_peak()  # a bad one: one line now, not after the initialisation
    if args.print_config:
        print(dump_config(config), end="")
        return 0
    if (args.target or args.devices is not None) and not args.dry_run:
        raise ConfigError("--target and --devices only apply to a check; add --dry-run.")
    at_least("--devices", args.devices, 1, "give the device count to simulate, e.g. 64")
    if args.devices is not None:
        simulate_cpu_devices(args.devices)
    for warning in config_warnings(config):
        print(f"warning: {warning}", file=sys.stderr, flush=True)
    launch = distributed.initialize(config)
    with distributed.exits_when_a_peer_fails(launch):
        config, chosen = schedule_choice.for_this_run(config, args.target)
        if chosen and jax.process_index() == 0:
            print(chosen, flush=True)
        if args.dry_run:
            dry_run(config, args.target)
        else:
            run_training(config)
    return 0


if __name__ == "__main__":
    exit_command(main())
