"""`pipeline.schedule: auto`: a pipelined run that names no schedule gets the fastest one that
fits the device's memory.

The candidates are every schedule the engine runs at the config's stages and microbatches
(interleaved and zbv with two chunks a rank, where the layers and microbatches allow it),
each with the rest of the config as given. The planner predicts each one's memory
(`memory.predict`) and step time (`cost.estimate`: compute stretched by the idle share the
engine's ticks leave, `pipeline/timeline.py`); the fastest that fits wins, and where
none fits, the one that needs least. The commands that start a run (`jaxtron.train`, its
`--dry-run`, `jaxtron.bench`) resolve it before building the trainer and print the choice
with its figures; a trainer built by hand needs a named schedule. A run that resumes keeps the
schedule its folder's run chose (`config.yaml`), so a restart never changes its layout.
Simulated CPU devices count the host's physical memory, shared: the same choice every start;
and since they share the host's cores too (`Hardware.shared_cores`), a rank's idle time is not
lost there, so the schedule with the least work wins.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax

from jaxtron.config.checks import check_layout
from jaxtron.config.loading import config_from_dict, config_to_dict, load_config
from jaxtron.config.platforms import local_platform
from jaxtron.config.schema import Config
from jaxtron.errors import ConfigError
from jaxtron.planner.cost import estimate
from jaxtron.planner.hardware import HARDWARE, Hardware
from jaxtron.planner.layout import layout_of
from jaxtron.planner.memory import predict
from jaxtron.sharding.mesh import resolve_degrees
from jaxtron.training.fits import device_bytes, host_total_bytes

AUTO = "auto"
OPTIONS = (("1f1b", 1), ("gpipe", 1), ("zb-h1", 1), ("zbv", 2), ("interleaved", 2))


@dataclasses.dataclass(frozen=True)
class Option:
    config: Config
    memory: int   # predicted bytes per device
    step_s: float
    idle: float   # a rank's idle share in this engine

    @property
    def name(self) -> str:
        p = self.config.pipeline
        return p.schedule + (f"/v{p.virtual_stages}" if p.schedule == "interleaved" else "")


def options(config: Config, degrees: dict[str, int], hardware: Hardware,
            platform: str) -> list[Option]:
    """Every schedule the config can run with, predicted; those a run would refuse are left
    out (interleaved needs microbatches a multiple of the stages, zbv two chunks' layers)."""
    found = []
    for schedule, virtual in OPTIONS:
        if config.pipeline.virtual_stages > 1 and virtual == 1:
            continue  # the user asked for chunks: only the schedules that run them
        virtual = max(virtual, config.pipeline.virtual_stages) if virtual > 1 else 1
        try:
            candidate = _named(config, schedule, virtual)
            check_layout(candidate, degrees)
        except ConfigError:
            continue
        layout = layout_of(candidate, degrees)
        cost = estimate(candidate, layout, hardware, platform)
        found.append(Option(candidate, predict(candidate, layout).total, cost.step_s,
                            cost.idle))
    return found


def choose(config: Config, devices: int, hardware: Hardware, budget: int | None,
           platform: str) -> tuple[Config, str]:
    """(config with its schedule named, the line that reports the choice); unchanged, with
    no line, when the config names a schedule or has no pipeline."""
    if config.pipeline.schedule != AUTO or config.mesh.stage == 1:
        return config, ""
    degrees = resolve_degrees(config.mesh, devices)
    found = options(config, degrees, hardware, platform)
    if not found:
        raise ConfigError(f"pipeline.schedule=auto found no schedule that runs "
                          f"mesh.stage={config.mesh.stage} with pipeline.microbatches="
                          f"{config.pipeline.microbatches}; set one, e.g. "
                          "pipeline.schedule=1f1b, and its check names what it needs.")
    fitting = [o for o in found if budget is None or o.memory <= budget]
    best = (min(fitting, key=lambda o: o.step_s) if fitting
            else min(found, key=lambda o: o.memory))
    gib = 2 ** 30
    others = ", ".join(f"{o.name} {o.step_s / best.step_s:.2f}x"
                       + ("" if o in fitting else " (does not fit)")
                       for o in found if o is not best)
    room = f" of {budget / gib:,.1f} GiB" if budget is not None else ""
    why = "the fastest that fits" if fitting else "none fits: the smallest"
    if hardware.shared_cores and fitting:
        why = "the least work that fits (simulated devices share this machine's cores)"
    return best.config, (f"pipeline.schedule=auto: {best.name}, {why} "
                         f"({best.memory / gib:,.2f} GiB predicted per device{room}; idle "
                         f"{best.idle:.3f}); the others' predicted step time: "
                         f"{others or 'none runs here'}")


def hardware_of(platform: str, device_kind: str) -> Hardware:
    """The planner's figures for the devices a run uses: the GPU named in the device kind
    (an H100 where none is known), or the CPU entry."""
    if platform == "cpu":
        return HARDWARE["cpu"]
    kind = device_kind.lower()
    return next((h for name, h in HARDWARE.items() if name in kind), HARDWARE["h100"])


def for_this_run(config: Config, target: str | None = None) -> tuple[Config, str]:
    """`choose` for the devices this process sees (or, for a dry run lowered for another
    platform, a typical device of it): their kind's figures and memory; or the choice of the
    run this one resumes."""
    if config.pipeline.schedule != AUTO or config.mesh.stage == 1:
        return config, ""
    devices, here = jax.devices(), local_platform()
    platform = target or here
    if platform != here:
        hardware = HARDWARE["tpu-v5p" if platform == "tpu" else "h100"]
        budget = hardware.memory_bytes
    elif here == "cpu":
        hardware, total = HARDWARE["cpu"], host_total_bytes()
        budget = None if total is None else total // jax.local_device_count()
    else:
        hardware, budget = hardware_of(here, devices[0].device_kind), device_bytes(devices[0])
    planner_platform = platform if platform in ("cpu", "tpu") else "gpu"
    return resolve(config, jax.device_count(), hardware, budget, planner_platform)


def resolve(config: Config, devices: int, hardware: Hardware, budget: int | None,
            platform: str) -> tuple[Config, str]:
    """The choice of the run this start continues, else `choose`'s."""
    if config.pipeline.schedule != AUTO or config.mesh.stage == 1:
        return config, ""
    resumed = _resumed_choice(config)
    if resumed is not None:
        return resumed
    return choose(config, devices, hardware, budget, platform)


def _resumed_choice(config: Config) -> tuple[Config, str] | None:
    """The schedule of the run in `train.run_dir` when this start continues it (same stages
    and microbatches), else None."""
    saved = Path(config.train.run_dir) / "config.yaml"
    if config.train.resume != "auto" or not saved.is_file():
        return None
    try:
        before = load_config(saved)
    except ConfigError:
        return None  # the resume itself reports a folder it cannot continue
    schedule, virtual = before.pipeline.schedule, before.pipeline.virtual_stages
    if (schedule == AUTO or before.mesh.stage != config.mesh.stage
            or before.pipeline.microbatches != config.pipeline.microbatches):
        return None
    return (_named(config, schedule, virtual),
            f"pipeline.schedule=auto: {schedule}, as the run it continues in {saved.parent} "
            "chose")


def _named(config: Config, schedule: str, virtual: int) -> Config:
    """`config` with the schedule named, checked like any loaded config."""
    raw = config_to_dict(config)
    raw["pipeline"].update(schedule=schedule, virtual_stages=virtual)
    return config_from_dict(raw)
