"""Megatron-LM's indexed dataset format: a flat `.bin` of tokens plus an `.idx` of offsets.

Files written here read in Megatron-LM (`MMIDIDX` version 1) and the reverse. A `.json`
sidecar records the tokenizer and vocabulary size so a run can check the model covers them.
The `.bin` is memory-mapped: nothing is loaded that a batch does not touch.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np

from jaxtron.errors import DataError

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
DTYPE_CODES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64,
               7: np.float32, 8: np.uint16}


def token_dtype(vocab_size: int):
    return np.uint16 if vocab_size < 2**16 else np.int32


def write_indexed(prefix: str | Path, documents, *, vocab_size: int, tokenizer: str,
                  eos_id: int | None) -> dict:
    """Write token-id documents (an iterable of int sequences) as `prefix.{bin,idx,json}`."""
    prefix = Path(prefix)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    dtype = token_dtype(vocab_size)
    lengths = []
    with open(f"{prefix}.bin", "wb") as out:
        for doc in documents:
            arr = np.asarray(list(doc) + ([eos_id] if eos_id is not None else []), dtype=dtype)
            if arr.size == 0:
                continue
            out.write(arr.tobytes())
            lengths.append(arr.size)
    if not lengths:
        raise DataError(f"no documents with text were found for {prefix}; point --input at a "
                        "folder or file that holds non-empty text.")
    lengths_np = np.asarray(lengths, dtype=np.int32)
    pointers = np.zeros(len(lengths), dtype=np.int64)
    pointers[1:] = np.cumsum(lengths_np[:-1], dtype=np.int64) * np.dtype(dtype).itemsize
    code = next(c for c, d in DTYPE_CODES.items() if d == dtype)
    with open(f"{prefix}.idx", "wb") as out:
        out.write(MAGIC)
        out.write(struct.pack("<Q", VERSION))
        out.write(struct.pack("<B", code))
        out.write(struct.pack("<Q", len(lengths)))
        out.write(struct.pack("<Q", len(lengths) + 1))
        out.write(lengths_np.tobytes())
        out.write(pointers.tobytes())
        out.write(np.arange(len(lengths) + 1, dtype=np.int64).tobytes())
    meta = {"tokenizer": tokenizer, "vocab_size": int(vocab_size), "eos_id": eos_id,
            "num_documents": len(lengths), "num_tokens": int(lengths_np.sum(dtype=np.int64))}
    Path(f"{prefix}.json").write_text(json.dumps(meta, indent=2))
    return meta


class IndexedDataset:
    """Read-only view of `prefix.bin` / `prefix.idx`: flat tokens and document boundaries."""

    def __init__(self, prefix: str | Path):
        prefix = Path(prefix)
        self.prefix = prefix
        for suffix in (".bin", ".idx"):
            if not Path(f"{prefix}{suffix}").is_file():
                raise DataError(f"data.path={prefix} has no {prefix}{suffix}; create the dataset "
                                "with python -m jaxtron.data.prepare --input DIR_OR_JSONL "
                                f"--out {prefix}, or use data.path=builtin:stdlib.")
        with open(f"{prefix}.idx", "rb") as f:
            header = f.read(len(MAGIC))
            if header != MAGIC:
                raise DataError(f"{prefix}.idx is not a Megatron MMIDIDX index (bad magic); "
                                "rebuild it with python -m jaxtron.data.prepare.")
            version, = struct.unpack("<Q", f.read(8))
            code, = struct.unpack("<B", f.read(1))
            count, = struct.unpack("<Q", f.read(8))
            struct.unpack("<Q", f.read(8))
            if version != VERSION or code not in DTYPE_CODES:
                raise DataError(f"{prefix}.idx has version {version} / dtype code {code}, which "
                                "this reader does not know; rebuild it with jaxtron.data.prepare.")
            offset = f.tell()
        self.dtype = np.dtype(DTYPE_CODES[code])
        self.lengths = np.memmap(f"{prefix}.idx", np.int32, "r", offset, (count,))
        self.pointers = np.memmap(f"{prefix}.idx", np.int64, "r", offset + 4 * count, (count,))
        self.tokens = np.memmap(f"{prefix}.bin", self.dtype, "r")
        expected = int(self.lengths.sum(dtype=np.int64))
        if self.tokens.size != expected:
            raise DataError(f"{prefix}.bin holds {self.tokens.size} tokens but {prefix}.idx "
                            f"describes {expected}; the files are truncated or mismatched, "
                            "rebuild them with python -m jaxtron.data.prepare.")
        meta_path = Path(f"{prefix}.json")
        self.meta = json.loads(meta_path.read_text()) if meta_path.is_file() else {}

    @property
    def num_documents(self) -> int:
        return len(self.lengths)

    def document_start(self, index: int) -> int:
        """Token offset of document `index` (num_documents = end of the last)."""
        if index >= self.num_documents:
            return int(self.tokens.size)
        return int(self.pointers[index]) // self.dtype.itemsize

    @property
    def vocab_size(self) -> int:
        if "vocab_size" in self.meta:
            return int(self.meta["vocab_size"])
        return int(self.tokens.max()) + 1
