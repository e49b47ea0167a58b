"""Training rows of one source: fixed-length windows over its token stream, and where their
documents begin.

Row i is `tokens[start + i*L : start + i*L + L + 1]` (inputs and shifted targets), as in
Megatron-LM's GPT dataset: documents are concatenated in order and a document longer than a row
continues in the next one. With `data.packing: documents` a row also says where each of its
documents begins, the way Megatron's `--reset-attention-mask --reset-position-ids` does:

    segment_ids[j]  which document of the row input token j belongs to (1, 2, ...), so attention
                    never crosses a document boundary;
    positions[j]    j's index within its document (restarting at each document start and at the
                    row start), for RoPE and learned position embeddings.

Rows are filled greedily with whole documents and the pieces of split ones, so no row holds
padding: every token is trained on (unlike first-fit packing, which pads each row, and which
needs an iterator over the whole stream rather than rows readable in any order).

`loss_mask[j]` (present with `documents` packing or `data.eod_mask_loss`) says whether the
prediction of target j + 1 counts: with `eod_mask_loss`, not the prediction from one document's
last token to the next document's first (Megatron's `--eod-mask-loss`, which masks predictions
made from the EOD token).

Fine-tuning data (a dataset with a `.mask.bin`) is packed differently, by `WholeExamples`: an
example cut at a row boundary would train its completion without its prompt, so each row holds
whole examples, greedily in order, padded at the end (segment id 0, masked), as Megatron's SFT
dataset keeps each sample whole. An example longer than a row is truncated to it and counted.
"""

from __future__ import annotations

import numpy as np

from jaxtron.data.indexed import IndexedDataset


class Windows:
    """Random-access rows of the token range [start, end) of `dataset`."""

    def __init__(self, dataset: IndexedDataset, start: int, end: int, seq_len: int, *,
                 documents: bool = False, eod_mask_loss: bool = False):
        self.tokens, self.start, self.seq_len = dataset.tokens, start, seq_len
        self.count = max(0, (end - start - 1) // seq_len)
        self.documents, self.eod_mask_loss = documents, eod_mask_loss
        self.with_mask = documents or eod_mask_loss
        self.offsets = dataset.document_offsets() if self.with_mask else None
        self.mask = dataset.loss_mask if self.with_mask else None

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> dict:
        begin = self.start + int(index) * self.seq_len
        stop = begin + self.seq_len + 1
        row = {"tokens": np.asarray(self.tokens[begin:stop], dtype=np.int32)}
        if not self.with_mask:
            return row
        absolute = np.arange(begin, stop)
        doc = np.searchsorted(self.offsets, absolute, side="right") - 1  # [L + 1]
        if self.documents:
            row["segment_ids"] = (doc[:-1] - doc[0] + 1).astype(np.int32)
            doc_start = np.maximum(self.offsets[doc[:-1]], begin)
            row["positions"] = (absolute[:-1] - doc_start).astype(np.int32)
        mask = (np.ones(self.seq_len, np.float32) if self.mask is None
                else np.asarray(self.mask[begin + 1:stop], dtype=np.float32))
        if self.eod_mask_loss:
            mask = mask * (doc[1:] == doc[:-1])
        row["loss_mask"] = mask
        return row


class WholeExamples:
    """Rows of whole examples (documents [first, last) of `dataset`), greedily packed in order,
    each row padded to L + 1 tokens; the loss mask is the dataset's, never across examples."""

    def __init__(self, dataset: IndexedDataset, first: int, last: int, seq_len: int):
        offsets = dataset.document_offsets()[first:last + 1]
        self.tokens, self.mask, self.width = dataset.tokens, dataset.loss_mask, seq_len + 1
        self.starts = offsets[:-1]
        self.lengths = np.minimum(np.diff(offsets), self.width)
        self.truncated = int((np.diff(offsets) > self.width).sum())
        rows, fill = [0], 0
        for i, length in enumerate(self.lengths.tolist()):  # greedy: next example or new row
            if fill + length > self.width:
                rows.append(i)
                fill = 0
            fill += length
        self.rows = np.asarray(rows + [len(self.lengths)])

    def __len__(self) -> int:
        return len(self.rows) - 1 if len(self.lengths) else 0

    def __getitem__(self, index: int) -> dict:
        width, examples = self.width, range(self.rows[index], self.rows[index + 1])
        tokens = np.zeros(width, np.int32)
        segment, position, trained = (np.zeros(width, np.int32), np.zeros(width, np.int32),
                                      np.zeros(width, np.float32))
        at = 0
        for n, example in enumerate(examples, start=1):
            start, length = int(self.starts[example]), int(self.lengths[example])
            tokens[at:at + length] = self.tokens[start:start + length]
            trained[at:at + length] = self.mask[start:start + length]
            segment[at:at + length] = n
            position[at:at + length] = np.arange(length)
            at += length
        same_example = (segment[1:] == segment[:-1]) & (segment[1:] > 0)
        return {"tokens": tokens, "segment_ids": segment[:-1], "positions": position[:-1],
                "loss_mask": trained[1:] * same_example}


def batch_keys(config) -> dict[str, tuple]:
    """Each key of a training batch -> (row shape, dtype): what `Windows` rows hold."""
    d = config.data
    keys = {"tokens": ((d.seq_len + 1,), np.int32)}
    if d.packing == "documents":
        keys["segment_ids"] = ((d.seq_len,), np.int32)
        keys["positions"] = ((d.seq_len,), np.int32)
    if d.packing == "documents" or d.eod_mask_loss:
        keys["loss_mask"] = ((d.seq_len,), np.float32)
    return keys
