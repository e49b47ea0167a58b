"""Batches per second of each input pipeline, side by side in one run.

    python -m jaxtron.data.throughput [--config configs/tiny.yaml] [--batches 200] [--workers 0 2]

Pipelines, all on the config's batch size and sequence length: `stream` (rows cut from the
token stream), `documents` (rows with segment ids, positions and a loss mask), `blend` (two
sources mixed 0.7 / 0.3, documents packed) and `sft` (a fine-tuning dataset with a loss mask),
each read with every `--workers` count. The built-in corpus is the first source; the second
source and the fine-tuning set are written to a temporary folder from the same text, so the
command needs nothing but Python. The train loop's `data_wait_s` metric says whether the
pipeline keeps up with the step; this says how far ahead of it the reader could run.
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile
import time
from pathlib import Path

import numpy as np

from jaxtron.config.loading import load_config
from jaxtron.config.schema import BlendSource, Config
from jaxtron.data.indexed import write_indexed
from jaxtron.data.pipeline import open_sources, train_batches
from jaxtron.errors import exits_on_user_error


def _second_source(folder: Path, first) -> str:
    """The first source's documents in reverse order, as another dataset."""
    dataset = first.dataset
    offsets = dataset.document_offsets()
    docs = [dataset.tokens[offsets[i]:offsets[i + 1]] for i in range(len(offsets) - 1)][::-1]
    write_indexed(folder / "reversed", docs, vocab_size=dataset.vocab_size,
                  tokenizer=dataset.meta.get("tokenizer", "unknown"), eos_id=None)
    return str(folder / "reversed")


def _fine_tuning_set(folder: Path, vocab: int, count: int = 4000) -> str:
    """Prompt/completion pairs, prompts masked out: the shape of real fine-tuning data."""
    rng = np.random.default_rng(0)
    docs, masks = [], []
    for _ in range(count):
        prompt, completion = (rng.integers(1, vocab, rng.integers(8, 64)),
                              rng.integers(1, vocab, 16))
        docs.append(np.concatenate([prompt, completion]).tolist())
        masks.append([0] * len(prompt) + [1] * len(completion))
    write_indexed(folder / "sft", docs, vocab_size=vocab, tokenizer="random", eos_id=0,
                  masks=masks)
    return str(folder / "sft")


def pipelines(config: Config, folder: Path) -> dict[str, Config]:
    first = open_sources(config)[0]
    other = _second_source(folder, first)
    data = config.data
    with_data = lambda **changes: dataclasses.replace(  # noqa: E731
        config, data=dataclasses.replace(data, **changes))
    blend = (BlendSource(path=data.path, weight=0.7, name="first"),
             BlendSource(path=other, weight=0.3, name="second"))
    return {"stream": with_data(packing="stream"),
            "documents": with_data(packing="documents", eod_mask_loss=True),
            "blend": with_data(packing="documents", blend=blend),
            "sft": with_data(packing="documents",
                             path=_fine_tuning_set(folder, config.model.vocab_size),
                             val_fraction=0.05)}


def batches_per_s(config: Config, batches: int) -> float:
    stream = train_batches(config, open_sources(config))
    next(stream)  # threads started, first batch read
    start = time.perf_counter()
    for _ in range(batches):
        next(stream)
    return batches / (time.perf_counter() - start)


@exits_on_user_error
def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="configs/tiny.yaml")
    parser.add_argument("--batches", type=int, default=200)
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 2])
    parser.add_argument("overrides", nargs="*", help="dotted config overrides")
    args = parser.parse_args(argv)
    config = load_config(args.config if Path(args.config).is_file() else None,
                             args.overrides)
    print(f"batch {config.train.batch_size} x {config.data.seq_len + 1} tokens, "
          f"{args.batches} batches each; batches/s (rows/s)")
    with tempfile.TemporaryDirectory() as folder:
        for name, variant in pipelines(config, Path(folder)).items():
            cells = []
            for workers in args.workers:
                read = dataclasses.replace(variant, data=dataclasses.replace(
                    variant.data, workers=workers))
                rate = batches_per_s(read, args.batches)
                cells.append(f"workers={workers}: {rate:8.1f} "
                             f"({rate * config.train.batch_size:,.0f})")
            print(f"  {name:<10} " + "   ".join(cells), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
