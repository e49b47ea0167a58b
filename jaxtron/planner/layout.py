"""A candidate layout: the config fields the planner chooses, and how to apply them."""

from __future__ import annotations

import dataclasses

from jaxtron.config.loading import config_from_dict, config_to_dict
from jaxtron.config.schema import Config, PipelineConfig


@dataclasses.dataclass(frozen=True)
class Layout:
    data: int = 1
    fsdp: int = 1
    tensor: int = 1
    sequence: int = 1
    expert: int = 1
    stage: int = 1
    sequence_parallel: bool = False
    zero_stage: int = 0
    remat: str = "none"
    microbatches: int = 1      # pipeline microbatches (stage > 1)
    grad_accum: int = 1
    schedule: str = "1f1b"
    virtual_stages: int = 1
    recompute: bool = True     # pipeline backward runs the stage again (False: stored residuals)
    context_parallel: str = "ring"  # with sequence > 1: ring, all_to_all or hybrid
    all_to_all_group: int = 1       # hybrid: ranks of sequence in each all-to-all

    @classmethod
    def of_fields(cls, fields: dict) -> Layout:
        """The layout with every one of `fields`, which names each field. The search builds
        half a million: the frozen dataclass's `__init__` sets each field through
        `object.__setattr__`, and filling the dict at once takes 6% off a large search."""
        layout = object.__new__(cls)
        layout.__dict__.update(fields)
        return layout

    @property
    def devices(self) -> int:
        return self.data * self.fsdp * self.tensor * self.sequence * self.expert * self.stage

    @property
    def all_to_all_size(self) -> int:
        """Devices in one all-to-all of context parallelism (1: none, a ring)."""
        if self.sequence == 1 or self.context_parallel == "ring":
            return 1
        return self.sequence if self.context_parallel == "all_to_all" else self.all_to_all_group

    @property
    def batch_split(self) -> int:
        """Ways the batch is divided: the data, fsdp and expert axes."""
        return self.data * self.fsdp * self.expert

    def degrees(self) -> dict[str, int]:
        return {"stage": self.stage, "data": self.data, "fsdp": self.fsdp,
                "expert": self.expert, "sequence": self.sequence, "tensor": self.tensor}

    def overrides(self) -> dict:
        """Dotted config keys that select this layout."""
        out = {f"mesh.{k}": v for k, v in self.degrees().items()}
        out.update({"mesh.sequence_parallel": self.sequence_parallel,
                    "optim.zero_stage": self.zero_stage, "model.remat": self.remat,
                    "optim.grad_accum": self.grad_accum})
        if self.sequence > 1:
            out["mesh.context_parallel"] = self.context_parallel
        if self.context_parallel == "hybrid":
            out["mesh.all_to_all_group"] = self.all_to_all_group
        if self.stage > 1:
            out.update({"pipeline.microbatches": self.microbatches,
                        "pipeline.schedule": self.schedule,
                        "pipeline.virtual_stages": self.virtual_stages,
                        "pipeline.recompute": self.recompute})
        return out

    def describe(self) -> str:
        parts = [f"{k}={v}" for k, v in self.degrees().items() if v > 1] or ["1 device"]
        if self.sequence > 1 and self.context_parallel != "ring":
            parts.append("a2a" if self.context_parallel == "all_to_all"
                         else f"hybrid a2a={self.all_to_all_group}")
        if self.sequence_parallel:
            parts.append("sp")
        if self.zero_stage:
            parts.append(f"zero{self.zero_stage}")
        if self.stage > 1:
            sched = self.schedule + (f"/v{self.virtual_stages}" if self.virtual_stages > 1 else "")
            parts.append(f"m={self.microbatches} {sched}" + ("" if self.recompute else " stored"))
        if self.grad_accum > 1:
            parts.append(f"accum={self.grad_accum}")
        parts.append(f"remat={self.remat}")
        return " ".join(parts)


def layout_of(config: Config, degrees: dict[str, int]) -> Layout:
    """The layout a config runs with on a mesh of `degrees` (the inverse of `apply`)."""
    c = config
    return Layout(**degrees, sequence_parallel=c.mesh.sequence_parallel,
                  zero_stage=c.optim.zero_stage, remat=c.model.remat,
                  microbatches=c.pipeline.microbatches, grad_accum=c.optim.grad_accum,
                  schedule=c.pipeline.schedule, virtual_stages=c.pipeline.virtual_stages,
                  recompute=c.pipeline.recompute,
                  context_parallel=c.mesh.context_parallel if degrees["sequence"] > 1 else "ring",
                  all_to_all_group=c.mesh.all_to_all_group)


def apply(config: Config, layout: Layout) -> Config:
    """`config` with `layout`'s fields, validated like any loaded config."""
    raw = config_to_dict(config)
    for key, value in layout.overrides().items():
        section, name = key.split(".")
        raw[section][name] = value
    for name in ("dcn_data", "dcn_fsdp", "dcn_stage"):
        raw["mesh"][name] = 1
    if layout.stage == 1:
        raw["pipeline"] = config_to_dict(PipelineConfig())
    return config_from_dict(raw)
