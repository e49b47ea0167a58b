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
prediction of target j + 1 counts: 0 for a fine-tuning dataset's prompt tokens (its `.mask.bin`)
and, with `eod_mask_loss`, for the prediction from one document's last token to the next
document's first (Megatron's `--eod-mask-loss`, which masks predictions made from the EOD token).
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
