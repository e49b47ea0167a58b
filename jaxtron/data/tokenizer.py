"""Tokenizers: bytes (built in, vocab 256) or a Hugging Face `tokenizers` JSON file.

The byte tokenizer maps UTF-8 bytes to ids 0-255 and uses byte 0 (NUL, which never occurs in
source text) as the end-of-document token.
"""

from __future__ import annotations

from pathlib import Path

from jaxtron.errors import DataError

BYTE_VOCAB = 256
BYTE_EOS = 0
EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>")


class ByteTokenizer:
    name = "byte"
    vocab_size = BYTE_VOCAB
    eos_id = BYTE_EOS

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids if 0 < int(i) < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A `tokenizers.Tokenizer` loaded from its tokenizer.json."""

    def __init__(self, path: str | Path):
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise DataError("a tokenizer file needs the `tokenizers` package; install it with "
                            "pip install 'jaxtron[hf]'.") from None
        path = Path(path)
        if not path.is_file():
            raise DataError(f"tokenizer file {path} does not exist; pass the tokenizer.json of a "
                            "Hugging Face tokenizer, or 'byte'.")
        self.name = str(path.resolve())
        try:
            self._tok = Tokenizer.from_file(str(path))
        except Exception as err:  # tokenizers raises a bare Exception for a malformed file
            first = (str(err).splitlines() or [type(err).__name__])[0][:200]
            raise DataError(f"tokenizer file {path} could not be read ({first}); pass the "
                            "tokenizer.json a Hugging Face tokenizer saves, or 'byte'.") from None
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        ids = [self._tok.token_to_id(t) for t in EOS_CANDIDATES]
        self.eos_id = next((i for i in ids if i is not None), None)
        unk = getattr(self._tok.model, "unk_token", None)
        self.unk_id = self._tok.token_to_id(unk) if unk else None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Ids of `text`; `add_special_tokens=False` leaves out what the tokenizer's
        post-processor adds (e.g. a BOS), for a piece that continues a document."""
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids])


def covering(tok, documents, source: str):
    """Pass `documents` (lists of ids) through, and refuse, once all are read, a tokenizer that
    turned most of the text into its unknown token: its output would train on nothing."""
    unk_id = getattr(tok, "unk_id", None)
    total = unknown = 0
    for ids in documents:
        if unk_id is not None:
            total += len(ids)
            unknown += sum(1 for i in ids if i == unk_id)
        yield ids
    if total and unknown * 2 > total:
        raise DataError(f"--tokenizer {tok.name} maps {unknown:,} of the {total:,} tokens of "
                        f"{source} to its unknown token: it does not cover this text; use a "
                        "tokenizer trained on such text, or 'byte'.")


def load_tokenizer(spec: str):
    """`byte` or a path to a tokenizer.json."""
    return ByteTokenizer() if spec == "byte" else HFTokenizer(spec)
