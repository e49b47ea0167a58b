"""Hugging Face model folders on disk: config.json plus one model.safetensors, or shards listed
in model.safetensors.index.json (as `save_pretrained(safe_serialization=True)` writes them).
Every way a folder can be unreadable is one `DataError` line naming the file."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from jaxtron.errors import DataError

SINGLE_FILE, INDEX_FILE = "model.safetensors", "model.safetensors.index.json"


def save_hf_dir(out_dir, hf_config: dict, state_dict: dict, *,
                max_shard_bytes: int | None = None) -> None:
    """Write config.json and model.safetensors, or with `max_shard_bytes` the shards
    model-0000i-of-0000n.safetensors and their model.safetensors.index.json."""
    from safetensors.numpy import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(hf_config, indent=2, sort_keys=True) + "\n")
    tensors = {name: np.ascontiguousarray(a) for name, a in state_dict.items()}
    metadata = {"format": "pt"}  # transformers refuses safetensors files without it
    if max_shard_bytes is None:
        save_file(tensors, str(out / SINGLE_FILE), metadata=metadata)
        return
    shards, size = [{}], 0
    for name, array in tensors.items():
        if shards[-1] and size + array.nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = array
        size += array.nbytes
    weight_map = {}
    for i, shard in enumerate(shards):
        filename = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / filename), metadata=metadata)
        weight_map.update(dict.fromkeys(shard, filename))
    index = {"metadata": {"total_size": sum(a.nbytes for a in tensors.values())},
             "weight_map": weight_map}
    (out / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def load_hf_dir(hf_dir) -> tuple[dict, dict[str, np.ndarray]]:
    """-> (config.json dict, {name: numpy array}) from one model.safetensors or shards listed in
    model.safetensors.index.json."""
    src = Path(hf_dir)
    if not (src / "config.json").is_file():
        raise DataError(f"{src} has no config.json: not a Hugging Face model directory; pass "
                        "--from-hf the folder that holds config.json and the safetensors.")
    hf_config = _read_json(src / "config.json")
    if not isinstance(hf_config, dict):
        raise DataError(f"{src / 'config.json'} must hold a JSON object; download the model "
                        "folder again.")
    if (src / SINGLE_FILE).is_file():
        return hf_config, _load_safetensors(src / SINGLE_FILE)
    if not (src / INDEX_FILE).is_file():
        found = ", ".join(sorted(os.listdir(src)))
        raise DataError(f"{src} has neither {SINGLE_FILE} nor {INDEX_FILE} (found: {found}); "
                        "only safetensors weights are read: save the model with "
                        "safe_serialization=True.")
    index = _read_json(src / INDEX_FILE)
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict):
        raise DataError(f"{src / INDEX_FILE} has no weight_map object; download the model "
                        "folder again.")
    tensors = {}
    for filename in sorted(set(weight_map.values())):
        if not (src / filename).is_file():
            raise DataError(f"{INDEX_FILE} lists {filename}, which is missing from {src}; "
                            "download the complete model folder.")
        tensors.update(_load_safetensors(src / filename))
    absent = sorted(set(weight_map) - tensors.keys())
    if absent:
        raise DataError(f"{INDEX_FILE} maps {absent[0]} to {weight_map[absent[0]]}, which does "
                        "not hold it; download the model folder again.")
    return hf_config, tensors


def _read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as err:
        raise DataError(f"{path} is not valid JSON ({type(err).__name__}: {str(err)[:120]}); "
                        "download the model folder again or fix the file.") from None


def _load_safetensors(path: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    try:
        return load_file(str(path))
    except Exception as err:  # safetensors raises its own error types for damaged files
        first = (str(err).splitlines() or [type(err).__name__])[0][:200]
        raise DataError(f"{path} could not be read ({first}): it is truncated or damaged; "
                        "download it again.") from None
