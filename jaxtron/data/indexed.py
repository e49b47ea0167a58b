"""Megatron-LM's indexed dataset format: a flat `.bin` of tokens plus an `.idx` of offsets.

Files written here read in Megatron-LM (`MMIDIDX` version 1) and the reverse. A `.json`
sidecar records the tokenizer, the vocabulary size and the largest token id so a run can check
the model covers them. The `.bin` is memory-mapped: nothing is loaded that a batch does not
touch. Opening checks the files agree (sizes from the `.idx` against the `.bin`), and each way a
file can be cut short or malformed is one error naming the file.
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
    lengths, max_id = [], 0
    with open(f"{prefix}.bin", "wb") as out:
        for doc in documents:
            arr = np.asarray(list(doc) + ([eos_id] if eos_id is not None else []), dtype=dtype)
            if arr.size == 0:
                continue
            out.write(arr.tobytes())
            lengths.append(arr.size)
            max_id = max(max_id, int(arr.max()))
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
            "num_documents": len(lengths), "num_tokens": int(lengths_np.sum(dtype=np.int64)),
            "max_token_id": max_id}
    Path(f"{prefix}.json").write_text(json.dumps(meta, indent=2))
    return meta


HEADER = len(MAGIC) + 8 + 1 + 8 + 8
# Datasets without a recorded max_token_id (Megatron's own, or older) are scanned when they
# hold at most this many tokens (a second or two); larger ones are not read in full at start.
SCAN_LIMIT = 2**30


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
        index = Path(f"{prefix}.idx")
        size = index.stat().st_size
        with open(index, "rb") as f:
            header = f.read(HEADER)
        if len(header) < HEADER:
            raise DataError(f"{index} is {size} bytes, shorter than an index header "
                            f"({HEADER} bytes): it is truncated; rebuild it with python -m jaxtron.data.prepare --out {prefix}.")
        if header[:len(MAGIC)] != MAGIC:
            raise DataError(f"{index} is not a Megatron MMIDIDX index (bad magic); "
                            f"rebuild it with python -m jaxtron.data.prepare --out {prefix}.")
        version, code, count, doc_count = struct.unpack("<QBQQ", header[len(MAGIC):])
        if version != VERSION or code not in DTYPE_CODES:
            raise DataError(f"{index} has version {version} / dtype code {code}, which this "
                            f"reader does not know; rebuild it with python -m jaxtron.data.prepare --out {prefix}.")
        body = count * (4 + 8) + doc_count * 8
        if size < HEADER + body:
            raise DataError(f"{index} describes {count} sequences but holds {size} bytes of the "
                            f"{HEADER + body} that needs: it is truncated; rebuild it with python -m jaxtron.data.prepare --out {prefix}.")
        self.dtype = np.dtype(DTYPE_CODES[code])
        self.lengths = np.memmap(index, np.int32, "r", HEADER, (count,))
        self.pointers = np.memmap(index, np.int64, "r", HEADER + 4 * count, (count,))
        self.tokens = self._tokens(prefix, int(self.lengths.sum(dtype=np.int64)))
        meta_path = Path(f"{prefix}.json")
        self.meta = {}
        if meta_path.is_file():
            try:
                self.meta = json.loads(meta_path.read_text())
            except (ValueError, UnicodeDecodeError) as err:
                raise DataError(f"{meta_path} is not valid JSON ({type(err).__name__}); fix it "
                                f"or delete it (it only records the tokenizer), or "
                                f"rebuild it with python -m jaxtron.data.prepare --out {prefix}.") from None
            if not isinstance(self.meta, dict):
                raise DataError(f"{meta_path} must hold a JSON object; fix it or delete it.")

    def _tokens(self, prefix, expected: int) -> np.ndarray:
        data = Path(f"{prefix}.bin")
        size = data.stat().st_size
        if size % self.dtype.itemsize:
            raise DataError(f"{data} is {size} bytes, not a whole number of "
                            f"{self.dtype.itemsize}-byte tokens: it is truncated or not a "
                            f"token file; rebuild it with python -m jaxtron.data.prepare --out {prefix}.")
        if size // self.dtype.itemsize != expected:
            raise DataError(f"{data} holds {size // self.dtype.itemsize} tokens but "
                            f"{prefix}.idx describes {expected}; the files are truncated or "
                            f"mismatched: rebuild it with python -m jaxtron.data.prepare --out {prefix}.")
        if expected == 0:
            raise DataError(f"{data} holds no tokens; prepare the dataset again from non-empty "
                            "text with python -m jaxtron.data.prepare.")
        return np.memmap(data, self.dtype, "r")

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
        largest = self.max_token_id()
        return largest + 1 if largest is not None else 0

    def max_token_id(self) -> int | None:
        """The largest id in the .bin: recorded at prepare time, else scanned in chunks when
        the dataset is small enough (None: too large to scan at every start, not recorded)."""
        recorded = self.meta.get("max_token_id")
        if isinstance(recorded, int):
            return recorded
        if self.tokens.size > SCAN_LIMIT:
            return None
        chunk, low, high = 2**24, 0, 0
        for i in range(0, self.tokens.size, chunk):
            part = self.tokens[i:i + chunk]
            low, high = min(low, int(part.min())), max(high, int(part.max()))
        if low < 0:
            raise DataError(f"{self.prefix}.bin holds the negative token id {low}; token ids "
                            "start at 0: prepare the data again with python -m "
                            "jaxtron.data.prepare.")
        return high
