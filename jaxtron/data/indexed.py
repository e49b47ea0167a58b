"""Megatron-LM's indexed dataset format: a flat `.bin` of tokens plus an `.idx` of offsets.

Files written here read in Megatron-LM (`MMIDIDX` version 1) and the reverse. A `.json`
sidecar records the tokenizer, the vocabulary size and the largest token id so a run can check
the model covers them. The `.bin` is memory-mapped: nothing is loaded that a batch does not
touch. Opening checks the files agree (sizes from the `.idx` against the `.bin`, the
`document_indices` against the sequence count), and each way a file can be cut short or
malformed is one error naming the file.

Fine-tuning data adds a loss mask: `PREFIX.mask.bin`, one uint8 per token of `PREFIX.bin`
(1 = the token is trained as a prediction target, 0 = it is context only), and
`"loss_mask": true` in `PREFIX.json`. Megatron ignores the extra file.
"""

from __future__ import annotations

import json
import struct
from contextlib import ExitStack
from pathlib import Path

import numpy as np

from jaxtron.errors import DataError

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
DTYPE_CODES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64,
               7: np.float32, 8: np.uint16}


def token_dtype(vocab_size: int):
    return np.uint16 if vocab_size < 2**16 else np.int32


_END = object()


def _mask_array(mask, count: int, number: int, prefix: Path) -> np.ndarray:
    """One document's loss mask as uint8, checked against its token count (EOS excluded)."""
    if len(mask) and not np.isscalar(mask[0]):  # one mask per sequence of the document
        mask = [v for part in mask for v in part]
    arr = np.asarray(mask, dtype=np.int64).reshape(-1)
    if arr.size != count:
        raise DataError(f"masks item {number} for {prefix} has {arr.size} entries but its "
                        f"document has {count} tokens (before EOS); pass one 0/1 per token.")
    if arr.size and (arr.min() < 0 or arr.max() > 1):
        raise DataError(f"masks item {number} for {prefix} holds values other than 0 and 1; "
                        "pass 1 for each trained token and 0 for the rest.")
    return arr.astype(np.uint8)


def write_indexed(prefix: str | Path, documents, *, vocab_size: int, tokenizer: str,
                  eos_id: int | None, masks=None, sequences_per_document: bool = False) -> dict:
    """Write token-id documents as `prefix.{bin,idx,json}` (and `prefix.mask.bin` with masks).

    Each item of `documents` is one document: a sequence of ids, or with
    `sequences_per_document=True` a list of such sequences (Megatron's `--split-sentences`
    layout: one `.idx` entry per sequence, `document_indices` grouping them). Empty sequences
    are dropped; `eos_id`, when given, is appended to each document's last sequence, and a
    document left with no tokens is skipped. `masks`, when given, runs parallel to
    `documents`: per document a sequence of 0/1 (1 = trained as a prediction target) as long as
    its tokens before EOS (for several sequences, flat or one list per sequence); the EOS gets
    1. It is written as `prefix.mask.bin`, one uint8 per token, and `"loss_mask": true` in the
    `.json`; without masks a stale `prefix.mask.bin` is removed. The files appear only once
    all are written: an error part way (a bad input line) leaves an older dataset as it was.
    """
    prefix = Path(prefix)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    names = {suffix: Path(f"{prefix}{suffix}") for suffix in (".bin", ".mask.bin", ".idx")}
    partial = {suffix: Path(f"{path}.partial") for suffix, path in names.items()}
    try:  # into .partial files, renamed at the end: a failure leaves an older dataset whole
        meta = _write_files(prefix, partial, documents, vocab_size, tokenizer, eos_id, masks,
                            sequences_per_document)
        for suffix, path in partial.items():
            if path.exists():
                path.replace(names[suffix])
        if masks is None:
            names[".mask.bin"].unlink(missing_ok=True)
        Path(f"{prefix}.json").write_text(json.dumps(meta, indent=2))
    finally:
        for path in partial.values():
            path.unlink(missing_ok=True)
    return meta


def _write_files(prefix: Path, paths: dict, documents, vocab_size, tokenizer, eos_id, masks,
                 sequences_per_document) -> dict:
    dtype = token_dtype(vocab_size)
    mask_items = iter(masks) if masks is not None else None
    lengths, document_indices, max_id, trained = [], [0], 0, 0
    with ExitStack() as files:
        out = files.enter_context(open(paths[".bin"], "wb"))
        mask_out = (files.enter_context(open(paths[".mask.bin"], "wb")) if masks is not None
                    else None)
        for number, doc in enumerate(documents):
            parts = [list(s) for s in doc] if sequences_per_document else [list(doc)]
            if mask_items is not None:
                mask = next(mask_items, _END)
                if mask is _END:
                    raise DataError(f"masks for {prefix} has {number} items but documents has "
                                    "more; pass one mask per document.")
                mask = _mask_array(mask, sum(len(p) for p in parts), number, prefix)
            parts = [p for p in parts if p]
            if eos_id is not None:
                parts = parts or [[]]
                parts[-1].append(eos_id)
                if mask_items is not None:
                    mask = np.append(mask, np.uint8(1))
            if not parts:
                continue
            for part in parts:
                arr = np.asarray(part, dtype=dtype)
                out.write(arr.tobytes())
                lengths.append(arr.size)
                max_id = max(max_id, int(arr.max()))
            document_indices.append(len(lengths))
            if mask_out is not None:
                mask_out.write(mask.tobytes())
                trained += int(mask.sum(dtype=np.int64))
        if mask_items is not None and next(mask_items, _END) is not _END:
            raise DataError(f"masks for {prefix} has more items than documents; pass one mask "
                            "per document.")
    if not lengths:
        raise DataError(f"no documents with text were found for {prefix}; point --input at a "
                        "folder or file that holds non-empty text.")
    lengths_np = np.asarray(lengths, dtype=np.int32)
    pointers = np.zeros(len(lengths), dtype=np.int64)
    pointers[1:] = np.cumsum(lengths_np[:-1], dtype=np.int64) * np.dtype(dtype).itemsize
    code = next(c for c, d in DTYPE_CODES.items() if d == dtype)
    with open(paths[".idx"], "wb") as out:
        out.write(MAGIC)
        out.write(struct.pack("<Q", VERSION))
        out.write(struct.pack("<B", code))
        out.write(struct.pack("<Q", len(lengths)))
        out.write(struct.pack("<Q", len(document_indices)))
        out.write(lengths_np.tobytes())
        out.write(pointers.tobytes())
        out.write(np.asarray(document_indices, dtype=np.int64).tobytes())
    meta = {"tokenizer": tokenizer, "vocab_size": int(vocab_size), "eos_id": eos_id,
            "num_documents": len(document_indices) - 1, "num_sequences": len(lengths),
            "num_tokens": int(lengths_np.sum(dtype=np.int64)), "max_token_id": max_id}
    if masks is not None:
        meta["loss_mask"] = True
        meta["num_trained_tokens"] = trained
    return meta


HEADER = len(MAGIC) + 8 + 1 + 8 + 8
# Datasets without a recorded max_token_id (Megatron's own, or older) are scanned when they
# hold at most this many tokens (a second or two); larger ones are not read in full at start.
SCAN_LIMIT = 2**30


class IndexedDataset:
    """Read-only view of `prefix.bin` / `prefix.idx`: flat tokens, document boundaries and,
    when `prefix.mask.bin` exists, the loss mask (`loss_mask`, one uint8 per token).

    The `.idx` lists sequences (`lengths`, byte `pointers`) and groups them into documents
    (`document_indices`): data prepared here has one sequence per document, Megatron's
    `--split-sentences` output several. Documents, not sequences, are the unit of the
    train/validation split.
    """

    def __init__(self, prefix: str | Path):
        prefix = Path(prefix)
        self.prefix = prefix
        for suffix in (".bin", ".idx"):
            if not Path(f"{prefix}{suffix}").is_file():
                raise DataError(f"data source {prefix} has no {prefix}{suffix}; create the dataset "
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
        self.document_indices = self._document_indices(index, count, doc_count)
        self._offsets = None
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
        self.loss_mask = self._loss_mask(prefix, meta_path)

    def _document_indices(self, index: Path, count: int, doc_count: int) -> np.ndarray:
        """The `.idx`'s document_indices, checked: document i spans sequences
        [d[i], d[i + 1]), so d starts at 0, never decreases and ends at the sequence count."""
        if doc_count == 0:
            raise DataError(f"{index} has no document_indices (Megatron writes at least the "
                            f"leading 0): it is malformed; rebuild it "
                            f"with python -m jaxtron.data.prepare --out {self.prefix}.")
        indices = np.memmap(index, np.int64, "r", HEADER + 12 * count, (doc_count,))
        if indices[0] != 0 or indices[-1] != count:
            raise DataError(f"{index} has document_indices from {int(indices[0])} to "
                            f"{int(indices[-1])}, not from 0 to its {count} sequences: it is "
                            f"malformed; rebuild it with python -m jaxtron.data.prepare --out "
                            f"{self.prefix}.")
        chunk = 2**24
        for i in range(0, doc_count - 1, chunk):
            part = np.asarray(indices[i:i + chunk + 1])
            if np.any(part[1:] < part[:-1]):
                at = i + int(np.argmax(part[1:] < part[:-1])) + 1
                raise DataError(f"{index} has document_indices that decrease at document {at} "
                                f"({int(indices[at - 1])} then {int(indices[at])}): it is "
                                f"malformed; rebuild it with python -m jaxtron.data.prepare --out "
                                f"{self.prefix}.")
        return indices

    def _loss_mask(self, prefix: Path, meta_path: Path) -> np.ndarray | None:
        """`prefix.mask.bin` (uint8 per token, 1 = trained as a target) or None."""
        path = Path(f"{prefix}.mask.bin")
        if not path.is_file():
            if self.meta.get("loss_mask"):
                raise DataError(f"{meta_path} says the dataset has a loss mask but {path} is "
                                f"missing; copy it next to {prefix}.bin, or rebuild it with "
                                f"python -m jaxtron.data.prepare --out {prefix}.")
            return None
        size = path.stat().st_size
        if size != self.tokens.size:
            raise DataError(f"{path} holds {size} mask bytes but {prefix}.bin holds "
                            f"{self.tokens.size} tokens; the files are mismatched: rebuild it "
                            f"with python -m jaxtron.data.prepare --out {prefix}, or delete "
                            f"{path} to train on every token.")
        return np.memmap(path, np.uint8, "r")

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
            raise DataError(f"{data} holds no tokens: the dataset file is empty; prepare the "
                            "dataset again from non-empty text with python -m "
                            "jaxtron.data.prepare.")
        return np.memmap(data, self.dtype, "r")

    @property
    def num_documents(self) -> int:
        """Documents (`document_indices` entries less one); each holds one or more sequences."""
        return len(self.document_indices) - 1

    def _sequence_start(self, sequence: int) -> int:
        if sequence >= len(self.pointers):
            return int(self.tokens.size)
        return int(self.pointers[sequence]) // self.dtype.itemsize

    def document_start(self, index: int) -> int:
        """Token offset of document `index` (num_documents = end of the last)."""
        if index >= self.num_documents:
            return int(self.tokens.size)
        return self._sequence_start(int(self.document_indices[index]))

    def document_offsets(self) -> np.ndarray:
        """int64 [num_documents + 1]: the token offset where each document starts, then the
        end of the tokens; computed once from pointers and document_indices."""
        if self._offsets is None:
            starts = np.empty(len(self.pointers) + 1, dtype=np.int64)
            starts[:-1] = self.pointers
            starts[:-1] //= self.dtype.itemsize
            starts[-1] = self.tokens.size
            self._offsets = starts[np.asarray(self.document_indices)]
        return self._offsets

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
