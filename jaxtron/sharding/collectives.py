"""Bytes each device sends per step, read from the compiled program: the communication
counterpart of XLA's memory analysis.

    compiled = trainer.compile_step(trainer.abstract_state(), trainer.abstract_batch())
    traffic = count_collectives(compiled.as_text(), trainer.mesh)
    traffic.sent("all-reduce", ("data",))      # bytes per device per step
    print(traffic.table())

Every collective of the partitioned HLO module is found with the mesh axes its device groups
span and the number of times it runs: a collective inside a `while` runs once per trip (XLA
records `known_trip_count` on loops of static length), and of a conditional's branches the one
that sends the most is counted (each pass runs one branch; this is an upper bound), unless every
branch's collectives name their share of the runs in their scope, as a pipeline's exchanges do
(`pipeline_exchange_ticks_<n>_of_<ticks>`: the tick table says which tick takes which): then
each branch counts at its share. Bytes are
those a device sends with ring algorithms, the convention of the planner
(`jaxtron/planner/cost.py`), for a collective over n devices on S bytes (the full array):

    all-reduce            2 S (n-1)/n        (reduce-scatter then all-gather)
    all-gather            S (n-1)/n          S = the gathered result
    reduce-scatter        S (n-1)/n          S = the input, n times the result
    all-to-all            S (n-1)/n
    collective-permute    S x (pairs / devices): the devices that send, averaged

Device ids in the module are positions in the mesh's device order, so each id's coordinates on
the mesh name the axes a group spans.
"""

from __future__ import annotations

import dataclasses
import re
from collections import defaultdict
from typing import Iterable, Mapping

import numpy as np

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4,
               "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
               "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3fnuz": 1, "f8e5m2fnuz": 1, "s4": 0.5,
               "u4": 0.5}

_HEADER = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) .*\{\s*$")
_INSTRUCTION = re.compile(r"^\s+(?:ROOT )?%?[\w.\-]+ = (.*?) ([a-z\-]+)\((.*)$")
_ARRAY = re.compile(r"\b([a-z]+\d*[a-z0-9]*)\[([\d,]*)\]")
_IDS = r"(?:\[[\d,]+\](?:T\([\d,]+\))?|[\d,\s]*)"  # device ids: an iota or a list
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_CALLEE = re.compile(r"\b(body|condition|calls|to_apply)=%?([\w.\-]+)")
_SHARE = re.compile(r"pipeline_exchange_ticks_(\d+)_of_(\d+)")
_BRANCHES = re.compile(r"\b(?:branch_computations=\{([^}]*)\}|"
                       r"(?:true|false)_computation=%?([\w.\-]+))")


@dataclasses.dataclass(frozen=True)
class Collective:
    kind: str
    axes: tuple[str, ...]     # mesh axes its groups span, in mesh order
    group: int                # devices per group (n)
    full_bytes: float         # S: the full array's bytes (see the module docstring)
    runs: int                 # times it runs per step
    sent_fraction: float = 1.0  # share of devices that send (collective-permute)

    @property
    def sent(self) -> float:
        """Bytes one device sends per step."""
        n, s = self.group, self.full_bytes
        if self.kind == "collective-permute":
            return s * self.sent_fraction * self.runs
        factor = 2 if self.kind == "all-reduce" else 1
        return factor * s * (n - 1) / n * self.runs


@dataclasses.dataclass(frozen=True)
class Traffic:
    collectives: tuple[Collective, ...]
    unknown_trip_counts: int = 0  # loops whose trip count XLA did not know (counted once)

    def _select(self, kind, axes) -> Iterable[Collective]:
        wanted = None if axes is None else tuple(axes)
        for c in self.collectives:
            if (kind is None or c.kind == kind) and (wanted is None or set(c.axes) ==
                                                     set(wanted)):
                yield c

    def sent(self, kind: str | None = None, axes: Iterable[str] | None = None) -> float:
        """Bytes one device sends per step by collectives of `kind` over exactly `axes`."""
        return float(sum(c.sent for c in self._select(kind, axes)))

    def full_bytes(self, kind: str | None = None, axes: Iterable[str] | None = None) -> float:
        """Summed full-array bytes (S) of those collectives, times their runs."""
        return float(sum(c.full_bytes * c.runs for c in self._select(kind, axes)))

    def count(self, kind: str | None = None, axes: Iterable[str] | None = None) -> int:
        return sum(c.runs for c in self._select(kind, axes))

    def by_axes(self) -> dict[tuple[str, ...], float]:
        """Bytes sent per device per step for each set of mesh axes."""
        out: dict[tuple[str, ...], float] = defaultdict(float)
        for c in self.collectives:
            out[c.axes] += c.sent
        return dict(out)

    def table(self) -> str:
        rows: dict[tuple[str, tuple[str, ...]], list[float]] = defaultdict(lambda: [0, 0.0])
        for c in self.collectives:
            rows[c.kind, c.axes][0] += c.runs
            rows[c.kind, c.axes][1] += c.sent
        lines = [f"  {kind:<19} over {'+'.join(axes) or '-':<22} {int(runs):>6} runs  "
                 f"{sent / 2**20:10.3f} MiB sent per device"
                 for (kind, axes), (runs, sent) in sorted(rows.items(), key=lambda r: -r[1][1])]
        total = sum(c.sent for c in self.collectives)
        lines.append(f"  total {total / 2**20:.3f} MiB sent per device per step")
        if self.unknown_trip_counts:
            lines.append(f"  ({self.unknown_trip_counts} loop(s) of unknown length counted "
                         "once)")
        return "\n".join(lines)


def count_collectives(hlo_text: str, mesh) -> Traffic:
    """The collectives of a compiled, partitioned HLO module on `mesh` (a jax Mesh, or a
    mapping of axis name to size in mesh order)."""
    shape = dict(mesh.shape) if hasattr(mesh, "shape") else dict(mesh)
    computations = _split_computations(hlo_text)
    entry = _entry_name(hlo_text)
    unknown = [0]

    def visit(name: str, runs: int) -> list[Collective]:
        found = []
        for line in computations.get(name, ()):
            match = _INSTRUCTION.match(line)
            if not match:
                continue
            result_type, op, rest = match.groups()
            kind = op.removesuffix("-start")
            if kind in KINDS and not op.endswith("-done"):
                found.append(_collective(kind, op, result_type, rest, shape, runs))
            if op == "while":
                trip = _TRIP.search(rest)
                unknown[0] += trip is None
                times = runs * (int(trip.group(1)) if trip else 1)
                for role, callee in _CALLEE.findall(rest):
                    if role in ("body", "condition"):
                        found += visit(callee, times)
            elif op == "conditional":
                names = _branch_names(rest)
                branches = [visit(b, runs) for b in names]
                shares = [_shares(computations.get(b, ())) if cs else (0, 1)
                          for b, cs in zip(names, branches)]
                if branches and all(share is not None for share in shares):
                    found += [dataclasses.replace(c, runs=runs * n // ticks)
                              for cs, (n, ticks) in zip(branches, shares) for c in cs]
                else:
                    found += max(branches, key=lambda cs: sum(c.sent for c in cs), default=[])
            else:
                for role, callee in _CALLEE.findall(rest):
                    if role == "calls":
                        found += visit(callee, runs)
        return found

    return Traffic(tuple(visit(entry, 1)), unknown[0])


def _shares(lines) -> tuple[int, int] | None:
    """(n, ticks) a branch's collectives name as their share of its conditional's runs; None
    where one names none, or they disagree."""
    found = set()
    for line in lines:
        match = _INSTRUCTION.match(line)
        if match and match.group(2).removesuffix("-start") in KINDS:
            share = _SHARE.search(match.group(3))
            if share is None:
                return None
            found.add((int(share.group(1)), int(share.group(2))))
    return found.pop() if len(found) == 1 else None


def _split_computations(text: str) -> dict[str, list[str]]:
    out, current = {}, None
    for line in text.splitlines():
        if current is None:
            header = _HEADER.match(line)
            if header:
                current = out.setdefault(header.group(1), [])
        elif line.startswith("}"):
            current = None
        else:
            current.append(line)
    return out


def _entry_name(text: str) -> str:
    for line in text.splitlines():
        if line.startswith("ENTRY "):
            return _HEADER.match(line).group(1)
    raise ValueError("the HLO module has no ENTRY computation")


def _branch_names(rest: str) -> list[str]:
    names = []
    for listed, single in _BRANCHES.findall(rest):
        names += [n.strip().lstrip("%") for n in listed.split(",") if n.strip()] or [single]
    return [n for n in names if n]


def _array_bytes(result_type: str) -> list[float]:
    return [DTYPE_BYTES.get(dtype, 4) * float(np.prod([int(d) for d in dims.split(",") if d]))
            for dtype, dims in _ARRAY.findall(result_type) if dtype in DTYPE_BYTES]


def _collective(kind, op, result_type, rest, shape: Mapping[str, int], runs) -> Collective:
    arrays = _array_bytes(result_type)
    devices = int(np.prod(list(shape.values())))
    if kind == "collective-permute":
        pairs = [tuple(map(int, p)) for p in re.findall(r"\{(\d+),(\d+)\}",
                                                        _field(rest, "source_target_pairs"))]
        size = arrays[0] if op.endswith("-start") else sum(arrays)
        axes = _axes_of_pairs(pairs, shape)
        return Collective(kind, axes, 2, size, runs, len(pairs) / devices)
    groups = _replica_groups(_field(rest, "replica_groups"), devices)
    n = len(groups[0])
    if op.endswith("-start") and kind in ("all-gather", "reduce-scatter"):
        arrays = arrays[len(arrays) // 2:]  # (operands..., results...)
    size = sum(arrays)
    if kind == "reduce-scatter":
        size *= n
    return Collective(kind, _axes_of_group(groups[0], shape), n, size, runs)


def _field(rest: str, name: str) -> str:
    """The text of attribute `name`: a balanced {...} or a bare token up to the next comma."""
    start = rest.find(name + "=")
    if start < 0:
        return ""
    i = start + len(name) + 1
    if rest[i] == "{":
        depth, j = 0, i
        while j < len(rest):
            depth += {"{": 1, "}": -1}.get(rest[j], 0)
            j += 1
            if depth == 0:
                break
        return rest[i:j]
    end = rest.find(", ", i)
    if rest.startswith("mesh[", i):  # mesh['a'=2,...][, device_ids=(...)] {'a'}
        close = rest.find("]", i)
        tail = re.match(r"(, device_ids=\(" + _IDS + r"\))?\s*(\{[^}]*\})?", rest[close + 1:])
        return rest[i:close + 1] + (tail.group(1) or "") + " " + (tail.group(2) or "")
    return rest[i:end if end >= 0 else len(rest)]


def _replica_groups(text: str, devices: int) -> list[list[int]]:
    """Explicit {{0,1},{2,3}}, iota [G,n]<=[dims]T(perm), or mesh['a'=2,'b'=4] {'b'}."""
    text = text.strip()
    if text.startswith("mesh["):
        sizes = [(name, int(size)) for name, size in re.findall(r"'(\w+)'=(\d+)", text)]
        after = text[text.find("]") + 1:]
        order = re.search(r"device_ids=\((" + _IDS + r")\)", after)
        chosen = re.findall(r"'(\w+)'", after[order.end() if order else 0:])
        ids = _device_order(order.group(1) if order else "", devices).reshape(
            [s for _, s in sizes])
        names = [n for n, _ in sizes]
        keep = [i for i, n in enumerate(names) if chosen and n not in chosen]
        picked = [i for i, n in enumerate(names) if not chosen or n in chosen]
        size = int(np.prod([sizes[i][1] for i in picked]))
        return ids.transpose(keep + picked).reshape(-1, size).tolist()
    if text.startswith("["):
        match = re.match(r"\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", text)
        groups_shape = [int(x) for x in match.group(1).split(",")]
        ids = np.arange(devices).reshape([int(x) for x in match.group(2).split(",")])
        if match.group(3):
            ids = ids.transpose([int(x) for x in match.group(3).split(",")])
        return ids.reshape(groups_shape[0], -1).tolist()
    groups = [[int(x) for x in g.split(",") if x] for g in re.findall(r"\{([\d,]*)\}", text)]
    groups = [g for g in groups if g]
    return groups or [list(range(devices))]


def _device_order(text: str, devices: int) -> np.ndarray:
    """Device ids listed explicitly (0,2,4,...), as an iota [2,4]T(1,0), or 0..n-1."""
    text = text.strip()
    if not text:
        return np.arange(devices)
    iota = re.match(r"\[([\d,]+)\](?:T\(([\d,]+)\))?", text)
    if iota:
        ids = np.arange(devices).reshape([int(x) for x in iota.group(1).split(",")])
        if iota.group(2):
            ids = ids.transpose([int(x) for x in iota.group(2).split(",")])
        return ids.reshape(-1)
    return np.array([int(x) for x in text.split(",") if x.strip()])


def _coordinates(ids, shape: Mapping[str, int]) -> np.ndarray:
    return np.stack(np.unravel_index(np.asarray(ids), list(shape.values())), axis=-1)


def _axes_of_group(group, shape: Mapping[str, int]) -> tuple[str, ...]:
    coords = _coordinates(group, shape)
    return tuple(name for i, name in enumerate(shape) if len(set(coords[:, i])) > 1)


def _axes_of_pairs(pairs, shape: Mapping[str, int]) -> tuple[str, ...]:
    if not pairs:
        return ()
    src, dst = _coordinates([p[0] for p in pairs], shape), _coordinates([p[1] for p in pairs],
                                                                         shape)
    return tuple(name for i, name in enumerate(shape) if np.any(src[:, i] != dst[:, i]))
