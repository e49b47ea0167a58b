"""Named device mesh built from the `mesh.*` degrees of the config.

Axis order runs from the slowest links to the fastest: pipeline stages and data replicas may
cross hosts, tensor parallelism stays innermost so its per-layer collectives ride the fastest
interconnect (Megatron's topology mapping). Axes are `Auto`, so GSPMD propagates shardings from
the few constraints the rules place.
"""

from __future__ import annotations

import math

import jax
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh

from jaxtron.config.schema import MeshConfig
from jaxtron.errors import ConfigError

MESH_AXES = ("stage", "data", "fsdp", "expert", "sequence", "tensor")


def resolve_degrees(mesh: MeshConfig, num_devices: int) -> dict[str, int]:
    """Replace the one `-1` degree by the devices left over and check the product."""
    degrees = {axis: getattr(mesh, axis) for axis in MESH_AXES}
    fixed = math.prod(d for d in degrees.values() if d != -1)
    rest = [axis for axis, d in degrees.items() if d == -1]
    if rest:
        if num_devices % fixed:
            raise ConfigError(
                f"the fixed mesh degrees multiply to {fixed}, which does not divide the "
                f"{num_devices} devices, so mesh.{rest[0]}=-1 cannot take the rest; change "
                f"{_describe(degrees)} so their product divides {num_devices}.")
        degrees[rest[0]] = num_devices // fixed
    total = math.prod(degrees.values())
    if total != num_devices:
        raise ConfigError(
            f"the mesh.* degrees {_describe(degrees)} multiply to {total}, but {num_devices} devices "
            f"are visible; make the product equal {num_devices} (set one degree to -1 to take "
            "the rest).")
    return degrees


def _describe(degrees: dict[str, int]) -> str:
    shown = [f"mesh.{a}={d}" for a, d in degrees.items() if d != 1] or ["all 1"]
    return " x ".join(shown)


def cross_host_degrees(mesh: MeshConfig) -> dict[str, int]:
    """The part of each degree that spans hosts (`mesh.dcn_*`); 1 for intra-host axes."""
    return {axis: getattr(mesh, f"dcn_{axis}", 1) for axis in MESH_AXES}


def build_mesh(mesh: MeshConfig, devices=None) -> Mesh:
    devices = list(devices if devices is not None else jax.devices())
    degrees = resolve_degrees(mesh, len(devices))
    shape = tuple(degrees[axis] for axis in MESH_AXES)
    axis_types = (AxisType.Auto,) * len(MESH_AXES)
    dcn = cross_host_degrees(mesh)
    hosts = len({d.process_index for d in devices})
    if math.prod(dcn.values()) == 1:
        return jax.make_mesh(shape, MESH_AXES, axis_types=axis_types, devices=devices)
    if math.prod(dcn.values()) != hosts:
        raise ConfigError(
            f"the cross-host degrees {_describe({f'dcn_{a}': d for a, d in dcn.items()})} "
            f"multiply to {math.prod(dcn.values())}, but the devices belong to {hosts} "
            "process(es); run one process per host and make the mesh.dcn_* product equal the "
            "host count.")
    inner = tuple(degrees[a] // dcn[a] for a in MESH_AXES)
    outer = tuple(dcn[a] for a in MESH_AXES)
    grid = mesh_utils.create_hybrid_device_mesh(inner, outer, devices, process_is_granule=True)
    return Mesh(grid, MESH_AXES, axis_types=axis_types)


def describe_mesh(mesh: Mesh, settings: MeshConfig | None = None) -> str:
    """"8 devices (data=2, sequence=4 all_to_all)": the degrees, and how the sequence is split
    when it is not a ring (hybrid with its all-to-all group)."""
    mode = settings.context_parallel if settings else "ring"
    how = {"ring": "", "all_to_all": " all_to_all",
           "hybrid": f" hybrid all_to_all_group={settings and settings.all_to_all_group}"}[mode]
    parts = [f"{name}={size}" + (how if name == "sequence" else "")
             for name, size in mesh.shape.items() if size > 1]
    return f"{mesh.devices.size} devices ({', '.join(parts) or 'single device'})"
