"""grain input pipeline: rows of every source (`windows.py`), shuffled, blended and batched.

Training rows are `seq_len + 1` tokens (inputs and shifted targets) cut at a stride of
`seq_len` from each source's training documents; the last `val_fraction` of each source's
documents (Megatron documents, whole) is held out for evaluation, per source. Shuffling is
grain's seeded index permutation, so the order depends only on `train.seed`; several sources
are mixed with grain's weighted `MapDataset.mix`. Every step reads global batch i, so the
iterator's state is just the next batch index: saving and restoring it resumes the exact
stream, mid-blend included. `data.workers` threads read `data.prefetch` batches ahead.

Each process reads only the rows of every global batch that its own devices hold (`rows`, from
`Trainer.local_rows()`), so several hosts together produce exactly the batch one process would.
"""

from __future__ import annotations

import dataclasses
import sys

import grain
import numpy as np

from jaxtron.config.schema import Config
from jaxtron.data.corpus import BUILTIN_STDLIB, builtin_prefix
from jaxtron.data.indexed import IndexedDataset
from jaxtron.data.windows import WholeExamples, Windows
from jaxtron.errors import DataError


class HostRows:
    """Batch i of this host: rows `rows` of global batch i of the shuffled stream, each key of
    the rows stacked."""

    def __init__(self, rows_ds: grain.MapDataset, global_batch: int, rows: slice | None):
        self.rows_ds, self.global_batch = rows_ds, global_batch
        self.rows = range(global_batch)[rows or slice(None)]
        self.offset = 0  # rows of the stream read before batch 0 (a resume at another size)

    def __call__(self, batch_index: int) -> dict:
        first = self.offset + batch_index * self.global_batch
        picked = [self.rows_ds[first + j] for j in self.rows]
        return {key: np.stack([row[key] for row in picked]) for key in picked[0]}


@dataclasses.dataclass(frozen=True)
class OpenSource:
    """One source of the blend, opened."""
    label: str
    weight: float
    dataset: IndexedDataset


def open_sources(config: Config) -> list[OpenSource]:
    """Every source of `data.blend` (or `data.path`), opened and checked."""
    sources = []
    for source in config.data.sources:
        dataset = open_dataset(config, source.path)
        if dataset.loss_mask is not None and config.data.packing != "documents":
            raise DataError(f"{source.path} is fine-tuning data (it has a loss mask, "
                            f"{source.path}.mask.bin) but data.packing={config.data.packing}; "
                            "set data.packing=documents so that each example attends only "
                            "to itself and only its completion is trained.")
        sources.append(OpenSource(source.label, source.weight, dataset))
    return sources


def open_dataset(config: Config, path: str | None = None) -> IndexedDataset:
    """The dataset at `path` (default `data.path`), checked against the model's vocabulary."""
    shown = path = path or config.data.path
    if path == BUILTIN_STDLIB:
        path = builtin_prefix(config.data.builtin_max_bytes)
    elif path.startswith("builtin:"):
        raise DataError(f"data source {path} is not a built-in corpus; the only one is "
                        f"{BUILTIN_STDLIB}; use it or give the prefix of a dataset written by "
                        "python -m jaxtron.data.prepare.")
    dataset = IndexedDataset(path)
    vocab = config.model.vocab_size
    if dataset.vocab_size > vocab:
        raise DataError(f"the dataset at {shown} uses {dataset.vocab_size} "
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
            raise DataError(f"the dataset at {shown} holds token id "
                            f"{largest}, outside model.vocab_size={vocab} (its {path}.json "
                            f"says vocab_size {dataset.meta.get('vocab_size', '-')}); set "
                            f"model.vocab_size={largest + 1} or more, or prepare the data again "
                            "with the model's tokenizer.")
    return dataset


def first_held_out(dataset: IndexedDataset, val_fraction: float) -> int:
    """Index of the first held-out document."""
    held_out = max(1, int(round(dataset.num_documents * val_fraction)))
    if held_out >= dataset.num_documents:
        raise DataError(f"{dataset.prefix} has {dataset.num_documents} documents, too few to "
                        f"hold out data.val_fraction={val_fraction} for evaluation and still "
                        "train; add documents or lower data.val_fraction.")
    return dataset.num_documents - held_out


def split_point(dataset: IndexedDataset, val_fraction: float) -> int:
    """Token offset where the held-out documents begin."""
    return dataset.document_start(first_held_out(dataset, val_fraction))


def _windows(config: Config, dataset: IndexedDataset, split: str):
    d = config.data
    if dataset.loss_mask is not None:  # fine-tuning examples: whole, one row or more each
        cut = first_held_out(dataset, d.val_fraction)
        first, last = (0, cut) if split == "train" else (cut, dataset.num_documents)
        windows = WholeExamples(dataset, first, last, d.seq_len)
        start, end = dataset.document_start(first), dataset.document_start(last)
        if windows.truncated and split == "train":
            print(f"note: {windows.truncated} examples of {dataset.prefix} are longer than "
                  f"data.seq_len+1={d.seq_len + 1} tokens and were cut to it; raise "
                  "data.seq_len to train them whole", file=sys.stderr, flush=True)
    else:
        cut = split_point(dataset, d.val_fraction)
        start, end = (0, cut) if split == "train" else (cut, int(dataset.tokens.size))
        windows = Windows(dataset, start, end, d.seq_len, documents=d.packing == "documents",
                          eod_mask_loss=d.eod_mask_loss)
    if len(windows) == 0:
        raise DataError(f"the {split} split of {dataset.prefix} has {end - start} "
                        f"tokens, fewer than one window of data.seq_len={d.seq_len}+1; "
                        "shorten data.seq_len or use more data.")
    return windows


def _as_sources(data) -> list[OpenSource]:
    if isinstance(data, IndexedDataset):
        return [OpenSource("", 1.0, data)]
    return list(data)


def train_batches(config: Config, data, rows: slice | None = None) -> "TrainStream":
    """Endless, checkpointable iterator of batches (`windows.batch_keys`: tokens
    int32[len(rows), seq_len + 1], and per-token layout and loss mask where configured): the
    rows `rows` (default all) of each global batch. `data`: `open_sources(config)`, or one
    opened dataset. Several sources are mixed by grain in proportion to their weights, each
    shuffled on its own (a source's order does not depend on the others)."""
    sources = _as_sources(data)
    streams = [grain.MapDataset.source(_windows(config, s.dataset, "train"))
               .shuffle(seed=config.train.seed + i).repeat() for i, s in enumerate(sources)]
    stream = (streams[0] if len(streams) == 1 else
              grain.MapDataset.mix(streams, [s.weight for s in sources]))
    d = config.data
    options = grain.ReadOptions(num_threads=d.workers, prefetch_buffer_size=d.prefetch)
    host_rows = HostRows(stream, config.train.batch_size, rows)
    batches = grain.MapDataset.range(sys.maxsize).map(host_rows).to_iter_dataset(options)
    return TrainStream(iter(batches), sources, host_rows)


class TrainStream:
    """The grain iterator plus the blend it draws from: its state records the weights, so a
    resume with other weights says so (the stream continues from the same batch index, drawn
    with the new proportions), and the rows read so far, so a resume with another
    `train.batch_size` continues at the row where the checkpoint's run stopped."""

    def __init__(self, iterator, sources: list[OpenSource], host_rows: HostRows):
        self.iterator, self.host_rows = iterator, host_rows
        # In order: a source's place sets its shuffle seed, so reordering is a change too.
        self.weights = [[s.label, str(s.dataset.prefix), s.weight] for s in sources]

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        return next(self.iterator)

    def get_state(self) -> dict:
        return {"stream": self.iterator.get_state(), "blend": self.weights,
                "global_batch": self.host_rows.global_batch,
                "row_offset": self.host_rows.offset}

    def set_state(self, state: dict) -> None:
        if "stream" not in state:  # a checkpoint that holds only the grain iterator's state
            self.iterator.set_state(state)
            return
        stream, batch = state["stream"], state.get("global_batch", self.host_rows.global_batch)
        offset = state.get("row_offset", 0)
        if batch != self.host_rows.global_batch and "next_index" in stream:
            offset += stream["next_index"] * batch  # the rows the checkpoint's run had read
            stream = {**stream, "next_index": 0}
            print(f"note: train.batch_size is {self.host_rows.global_batch} (the checkpoint's "
                  f"run: {batch}): the data stream continues at row {offset}, where that run "
                  "stopped", file=sys.stderr, flush=True)
        self.host_rows.offset = offset
        self.iterator.set_state(stream)
        if state.get("blend") != self.weights:
            print(f"note: data blend changed on resume: was {state.get('blend')}, now "
                  f"{self.weights}; batches from here on are drawn with the new weights",
                  file=sys.stderr, flush=True)


def eval_batches(config: Config, data, rows: slice | None = None) -> list[tuple[str, list]]:
    """(label, batches) per source: the same held-out batches at every evaluation, in order,
    wrapping if the split is small."""
    held_out = []
    for source in _as_sources(data):
        windows = grain.MapDataset.source(_windows(config, source.dataset, "validation"))
        host_rows = HostRows(windows.repeat(), config.train.batch_size, rows)
        held_out.append((source.label, [host_rows(i) for i in range(config.train.eval_batches)]))
    return held_out
