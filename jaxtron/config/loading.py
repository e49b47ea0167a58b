"""A config from a YAML file and dotted overrides, and back to YAML.

    load_config("configs/tiny.yaml", ["train.steps=50", "model.num_layers=4"])

Unknown keys, wrong types and choices outside a field's list raise `ConfigError` naming the
field path and the fix; then `checks.validate` refuses impossible combinations.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from pathlib import Path
from typing import Any

import yaml

from jaxtron.config.checks import validate
from jaxtron.config.schema import BlendSource, Config
from jaxtron.errors import ConfigError


def _allowed_types(annotation) -> tuple[type, ...]:
    hint = (eval(annotation, {**vars(typing), "BlendSource": BlendSource})
            if isinstance(annotation, str) else annotation)
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        return tuple(typing.get_args(hint))
    return (hint,)


def _coerce(path: str, value: Any, annotation) -> Any:
    allowed = _allowed_types(annotation)
    if value is None:
        if type(None) in allowed:
            return None
        raise ConfigError(f"{path} may not be null; give a {allowed[0].__name__}.")
    for t in allowed:
        if typing.get_origin(t) is tuple and isinstance(value, (list, tuple)):
            item = typing.get_args(t)[0]
            if dataclasses.is_dataclass(item):
                return tuple(_build(item, v, f"{path}[{i}].") for i, v in enumerate(value))
            return tuple(_coerce(f"{path}[{i}]", v, item) for i, v in enumerate(value))
        if t is bool and isinstance(value, bool):
            return value
        if t is int and isinstance(value, int) and not isinstance(value, bool):
            return value
        if t is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return _finite(path, float(value))
        if t is str and isinstance(value, str):
            return value
        if t is float and isinstance(value, str):  # YAML 1.1 reads 1e-3 (no dot) as a string
            try:
                return _finite(path, float(value))
            except ValueError:
                pass
    names = " or ".join("a list" if typing.get_origin(t) is tuple else t.__name__
                        for t in allowed if t is not type(None))
    raise ConfigError(f"{path}={value!r} has type {type(value).__name__}; it must be {names}.")


def _finite(path: str, value: float) -> float:
    """Every number in a config is finite: inf or nan is never a setting, only a typo."""
    if not math.isfinite(value):
        raise ConfigError(f"{path}={value} is not a finite number; give a finite value.")
    return value


def _build(cls, raw: dict, prefix: str):
    if not isinstance(raw, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'the config'} must be a mapping of keys to values, "
                          f"got {raw!r}.")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in raw.items():
        path = f"{prefix}{key}"
        if key not in fields:
            close = difflib.get_close_matches(str(key), fields, n=1)
            hint = f" Did you mean {prefix}{close[0]}?" if close else ""
            raise ConfigError(f"unknown config key {path}.{hint} Valid keys here: "
                              f"{', '.join(sorted(fields))}; fix the spelling or remove the key.")
        f = fields[key]
        if dataclasses.is_dataclass(f.default_factory if f.default_factory is not
                                    dataclasses.MISSING else None):
            kwargs[key] = _build(f.default_factory, value or {}, f"{path}.")
            continue
        value = _coerce(path, value, f.type)
        choices = f.metadata.get("choices")
        if choices and value not in choices:
            raise ConfigError(f"{path}={value!r} is not supported; choose one of "
                              f"{', '.join(map(str, choices))}.")
        kwargs[key] = value
    return cls(**kwargs)


def _set_dotted(tree: dict, dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = tree
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {dotted}: {part} is a value, not a section; write the "
                              "full dotted key, e.g. model.d_model=256.")
    node[parts[-1]] = value


def parse_override(text: str) -> tuple[str, Any]:
    """`train.steps=50` -> ("train.steps", 50); values are parsed as YAML scalars."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} must look like section.key=value, "
                          "for example train.steps=50.")
    key, raw = text.split("=", 1)
    try:
        value = yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError:
        value = raw
    return key.strip(), value


def config_from_dict(raw: dict, overrides: list[str] = ()) -> Config:
    tree = _deep_copy(raw or {})
    for text in overrides:
        key, value = parse_override(text)
        _set_dotted(tree, key, value)
    config = _build(Config, tree, "")
    validate(config)
    return config


def _deep_copy(tree):
    return {k: _deep_copy(v) if isinstance(v, dict) else v for k, v in tree.items()}


def load_config(path: str | Path | None, overrides: list[str] = ()) -> Config:
    raw = {}
    if path is not None:
        raw = _read_yaml(Path(path))
    return config_from_dict(raw, overrides)


class DuplicateKey(Exception):
    def __init__(self, key, line: int):
        super().__init__(key)
        self.key, self.line = key, line


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a key set twice in one mapping (the last would win)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise DuplicateKey(key, key_node.start_mark.line + 1)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _read_yaml(path: Path) -> dict:
    """The mapping in a config file; every way it can fail is one line naming the file."""
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist; pass --config with a path such "
                          "as configs/tiny.yaml.")
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as err:
        raise ConfigError(f"config file {path} is not UTF-8 text (byte {err.start}); save it "
                          "as UTF-8.") from None
    try:
        raw = yaml.load(text, Loader=_UniqueKeyLoader)
    except DuplicateKey as err:
        raise ConfigError(f"config file {path} sets {err.key!r} twice (line {err.line}); the "
                          "second would silently replace the first: keep one.") from None
    except yaml.YAMLError as err:
        where = getattr(err, "problem_mark", None)
        line = f" at line {where.line + 1}" if where is not None else ""
        problem = getattr(err, "problem", None) or type(err).__name__
        raise ConfigError(f"config file {path} is not valid YAML{line} ({problem}); fix the "
                          "syntax there.") from None
    if raw is None:
        raise ConfigError(f"config file {path} is empty; give at least one section, e.g. "
                          "'model: {num_layers: 2}', or start from configs/tiny.yaml.")
    if not isinstance(raw, dict):
        raise ConfigError(f"config file {path} holds a YAML {type(raw).__name__}, not a "
                          "mapping of sections; write it as 'section: {key: value}' lines like "
                          "configs/tiny.yaml.")
    return raw


def _type_name(annotation) -> str:
    names = []
    for t in _allowed_types(annotation):
        if t is type(None):
            continue
        names.append(f"list[{typing.get_args(t)[0].__name__}]" if typing.get_origin(t) is tuple
                     else t.__name__)
    return " | ".join(names)


def field_reference(cls=Config, prefix: str = "") -> list[tuple[str, str, str, str]]:
    """(dotted key, type, default, meaning) for every field: what `--help` prints."""
    rows = []
    for f in dataclasses.fields(cls):
        if f.default_factory is not dataclasses.MISSING:
            rows += field_reference(f.default_factory, f"{prefix}{f.name}.")
            continue
        meaning = f.metadata.get("help", "")
        if f.metadata.get("choices"):
            meaning += f" [{', '.join(map(str, f.metadata['choices']))}]"
        default = yaml.safe_dump(f.default, default_flow_style=True).strip()
        default = default.removesuffix("\n...").removesuffix("...").strip()
        rows.append((f"{prefix}{f.name}", _type_name(f.type), default, meaning))
    return rows


def format_field_reference() -> str:
    """Every config field, grouped by section, one line each."""
    lines, section = [], None
    for key, type_name, default, meaning in field_reference():
        head = key.split(".")[0]
        if head != section:
            section = head
            lines.append(f"{section}:")
        lines.append(f"  {key:<30} {type_name:<10} {default:<17} {meaning}")
    return "\n".join(lines)


def config_to_dict(config) -> dict:
    return dataclasses.asdict(config)


def dump_config(config: Config) -> str:
    return yaml.safe_dump(config_to_dict(config), sort_keys=False)


def single_device_config(config: Config) -> Config:
    """The same model on one device: every parallel degree 1."""
    raw = config_to_dict(config)
    raw["mesh"] = {}
    raw["pipeline"] = {}
    raw["optim"]["zero_stage"] = 0
    return config_from_dict(raw)
