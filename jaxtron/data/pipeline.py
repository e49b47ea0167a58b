"""grain input pipeline: fixed-length windows over the token memmap, shuffled and batched.

Training windows are `seq_len + 1` tokens (inputs and shifted targets) cut at a stride of
`seq_len` from the training documents; the last `val_fraction` of documents is held out for
evaluation. Shuffling is grain's seeded index permutation, reshuffled each epoch, so the order
depends only on `train.seed`. The iterator's state is just the next batch index: saving and
restoring it resumes the exact stream.

Each process reads only the rows of every global batch that its own devices hold (`rows`, from
`Trainer.local_rows()`), so several hosts together produce exactly the batch one process would.
"""

from __future__ import annotations

import sys

import grain
import numpy as np

from jaxtron.config import Config
from jaxtron.data.corpus import BUILTIN_STDLIB, builtin_prefix
from jaxtron.data.indexed import IndexedDataset
from jaxtron.errors import DataError


class TokenWindows:
    """Random-access source: window i = tokens[start + i*L : start + i*L + L + 1]."""

    def __init__(self, tokens: np.ndarray, start: int, end: int, seq_len: int):
        self.tokens, self.start, self.seq_len = tokens, start, seq_len
        self.count = max(0, (end - start - 1) // seq_len)

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> np.ndarray:
        begin = self.start + int(index) * self.seq_len
        return np.asarray(self.tokens[begin:begin + self.seq_len + 1], dtype=np.int32)


class HostRows:
    """Batch i of this host: rows `rows` of global batch i of the shuffled stream."""

    def __init__(self, windows: grain.MapDataset, global_batch: int, rows: slice | None):
        self.windows, self.global_batch = windows, global_batch
        self.rows = range(global_batch)[rows or slice(None)]

    def __call__(self, batch_index: int) -> dict:
        first = batch_index * self.global_batch
        return {"tokens": np.stack([self.windows[first + j] for j in self.rows])}


def open_dataset(config: Config) -> IndexedDataset:
    path = config.data.path
    if path == BUILTIN_STDLIB:
        path = builtin_prefix(config.data.builtin_max_bytes)
    elif path.startswith("builtin:"):
        raise DataError(f"data.path={path} is not a built-in corpus; the only one is "
                        f"{BUILTIN_STDLIB}; use it or give the prefix of a dataset written by "
                        "python -m jaxtron.data.prepare.")
    dataset = IndexedDataset(path)
    vocab = config.model.vocab_size
    if dataset.vocab_size > vocab:
        raise DataError(f"the dataset at data.path={config.data.path} uses {dataset.vocab_size} "
                        f"token ids but model.vocab_size={vocab}; set "
                        f"model.vocab_size={dataset.vocab_size} or more.")
    # The sidecar's word is not enough: an id past the embedding table gathers garbage (NaN at
    # the first step on GPUs). Ids that the token dtype cannot exceed need no scan.
    bounded = dataset.dtype.kind == "u" and np.iinfo(dataset.dtype).max < vocab
    if not bounded:
        largest = dataset.max_token_id()
        if largest is None:
            print(f"note: {dataset.tokens.size:,} tokens in {path}.bin and no max_token_id in "
                  f"its .json: token ids were not checked against model.vocab_size",
                  file=sys.stderr, flush=True)
        elif largest >= vocab:
            raise DataError(f"the dataset at data.path={config.data.path} holds token id "
                            f"{largest}, outside model.vocab_size={vocab} (its {path}.json "
                            f"says vocab_size {dataset.meta.get('vocab_size', '-')}); set "
                            f"model.vocab_size={largest + 1} or more, or prepare the data again "
                            "with the model's tokenizer.")
    return dataset


def split_point(dataset: IndexedDataset, val_fraction: float) -> int:
    """Token offset where the held-out documents begin."""
    held_out = max(1, int(round(dataset.num_documents * val_fraction)))
    if held_out >= dataset.num_documents:
        raise DataError(f"the dataset has {dataset.num_documents} documents, too few to hold "
                        f"out data.val_fraction={val_fraction} for evaluation and still train; "
                        "add documents or lower data.val_fraction.")
    return dataset.document_start(dataset.num_documents - held_out)


def _windows(config: Config, dataset: IndexedDataset, split: str) -> TokenWindows:
    cut = split_point(dataset, config.data.val_fraction)
    start, end = (0, cut) if split == "train" else (cut, int(dataset.tokens.size))
    windows = TokenWindows(dataset.tokens, start, end, config.data.seq_len)
    if len(windows) == 0:
        raise DataError(f"the {split} split of data.path={config.data.path} has {end - start} "
                        f"tokens, fewer than one window of data.seq_len={config.data.seq_len}+1; "
                        "shorten data.seq_len or use more data.")
    return windows


def train_batches(config: Config, dataset: IndexedDataset,
                  rows: slice | None = None) -> grain.DatasetIterator:
    """Endless, checkpointable iterator of {"tokens": int32[len(rows), seq_len + 1]}: the rows
    `rows` (default all) of each global batch."""
    windows = grain.MapDataset.source(_windows(config, dataset, "train"))
    stream = windows.shuffle(seed=config.train.seed).repeat()
    return iter(grain.MapDataset.range(sys.maxsize).map(
        HostRows(stream, config.train.batch_size, rows)).to_iter_dataset())


def eval_batches(config: Config, dataset: IndexedDataset,
                 rows: slice | None = None) -> list[dict]:
    """The same held-out batches at every evaluation, in order, wrapping if the split is small."""
    windows = grain.MapDataset.source(_windows(config, dataset, "validation")).repeat()
    host_rows = HostRows(windows, config.train.batch_size, rows)
    return [host_rows(i) for i in range(config.train.eval_batches)]
