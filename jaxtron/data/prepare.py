"""Turn text into a Megatron-format token dataset (`PREFIX.bin`, `PREFIX.idx`, `PREFIX.json`).

    python -m jaxtron.data.prepare --input corpus/ --out data/mycorpus
    python -m jaxtron.data.prepare --input docs.jsonl --jsonl-key text --out data/docs \
        --tokenizer tokenizer.json
    python -m jaxtron.data.prepare --jsonl sft.jsonl --out data/sft   # prompt/completion
    python -m jaxtron.data.prepare --jsonl chats.jsonl --messages-key messages --out data/chat

Input is a folder (every file under it whose name matches --glob, one document per file), a
single text file (one document), or a JSONL file (one document per line, text under
--jsonl-key). Then train with `data.path=PREFIX`.

Fine-tuning examples (`--jsonl`) are one per line: a prompt and a completion (fields named by
--prompt-key and --completion-key) or a chat (a list of {role, content} turns under
--messages-key). Each becomes one document, and `PREFIX.mask.bin` marks the tokens trained
as targets: the completion or the assistant turns, and the EOS. `jaxtron/data/sft.py` gives
the chat template.

Files are decoded with --encoding (UTF-8 by default); a byte that is not valid there becomes
U+FFFD and the summary counts such replacements, so latin-1 text read as UTF-8 is reported, not
silently mangled (pass --encoding latin-1 for it). Binary files in a folder (a NUL byte in their
first 8 KiB, as `grep` and `git` decide) are skipped and counted.
"""

from __future__ import annotations

import argparse
import sys
from collections import deque
from pathlib import Path

from jaxtron.data import sft
from jaxtron.data.indexed import write_indexed
from jaxtron.data.sft import json_type, jsonl_records
from jaxtron.data.tokenizer import covering, load_tokenizer
from jaxtron.errors import DataError, exits_on_user_error


class Summary:
    """What reading the input skipped or repaired, for the closing line."""

    def __init__(self):
        self.binary_files = 0
        self.replaced = 0  # undecodable bytes turned into U+FFFD
        self.files_with_replacements = 0

    def decode(self, data: bytes, encoding: str) -> str:
        text = data.decode(encoding, errors="replace")
        marker = "\ufffd".encode(encoding, errors="ignore")  # U+FFFD already in the text
        bad = text.count("\ufffd") - (data.count(marker) if marker else 0)
        if bad > 0:
            self.replaced += bad
            self.files_with_replacements += 1
        return text

    def notes(self, encoding: str) -> list[str]:
        notes = []
        if self.binary_files:
            notes.append(f"skipped {self.binary_files} binary files")
        if self.replaced:
            notes.append(f"replaced {self.replaced} bytes that are not {encoding} in "
                         f"{self.files_with_replacements} documents with U+FFFD (pass "
                         "--encoding with the files' encoding, e.g. latin-1)")
        return notes


def _is_binary(data: bytes) -> bool:
    return b"\0" in data[:8192]


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as err:
        raise DataError(f"cannot read {path} ({err.strerror}); fix its permissions or leave it "
                        "out of --input.") from None


def read_documents(path: Path, pattern: str, jsonl_key: str, encoding: str = "utf-8",
                   summary: Summary | None = None):
    summary = summary or Summary()
    if path.is_dir():
        files = sorted(p for p in path.rglob(pattern) if p.is_file())
        if not files:
            raise DataError(f"--input {path} has no files matching --glob {pattern!r}; pass a "
                            "--glob that matches its text files, e.g. '*.txt'.")
        for file in files:
            data = _read(file)
            if _is_binary(data):
                summary.binary_files += 1
                continue
            yield summary.decode(data, encoding)
    elif path.suffix == ".jsonl":
        for line_no, record in jsonl_records(path, encoding):
            if jsonl_key not in record:
                raise DataError(f"{path} line {line_no} has no {jsonl_key!r} field; pass "
                                "--jsonl-key with the field that holds the text.")
            text = record[jsonl_key]
            if not isinstance(text, str):
                raise DataError(f"{path} line {line_no} field {jsonl_key!r} is a JSON "
                                f"{json_type(text)}, not a string; fix that line or pass "
                                "--jsonl-key with the field that holds the text.")
            yield text
    elif path.is_file():
        data = _read(path)
        if _is_binary(data):
            raise DataError(f"--input {path} is a binary file (it holds NUL bytes); give a "
                            "text file, a folder of text files or a .jsonl file.")
        yield summary.decode(data, encoding)
    else:
        raise DataError(f"--input {path} does not exist; give a folder, a text file or a "
                        ".jsonl file.")


def _check_encoding(encoding: str):
    try:
        "".encode(encoding)
    except LookupError:
        raise DataError(f"--encoding {encoding} is not a text encoding Python knows; use e.g. "
                        "utf-8 or latin-1.") from None


def _write(out, documents, tok, masks=None) -> dict:
    try:
        return write_indexed(out, documents, vocab_size=tok.vocab_size, tokenizer=tok.name,
                             eos_id=tok.eos_id, masks=masks)
    except OSError as err:
        raise DataError(f"cannot write {out}.bin/.idx ({err.strerror}: {err.filename}); choose "
                        "an --out prefix in a folder you can write to.") from None


def prepare(input_path, out, tokenizer="byte", pattern="*", jsonl_key="text",
            encoding="utf-8") -> dict:
    _check_encoding(encoding)
    tok = load_tokenizer(tokenizer)
    summary = Summary()
    texts = read_documents(Path(input_path), pattern, jsonl_key, encoding, summary)
    meta = _write(out, covering(tok, (tok.encode(text) for text in texts), input_path), tok)
    meta["notes"] = summary.notes(encoding)
    return meta


def prepare_sft(jsonl, out, tokenizer="byte", prompt_key="prompt", completion_key="completion",
                messages_key=None, encoding="utf-8") -> dict:
    """Fine-tuning data: one document per JSONL line and a loss mask over what is trained
    (completion or assistant turns, and the EOS); see jaxtron.data.sft for the shapes."""
    _check_encoding(encoding)
    tok = load_tokenizer(tokenizer)
    pending = deque()  # each example's mask, taken by write_indexed right after its ids

    def documents():
        for pieces in sft.read_examples(Path(jsonl), prompt_key=prompt_key,
                                        completion_key=completion_key,
                                        messages_key=messages_key, encoding=encoding):
            ids, mask = sft.tokenize(tok, pieces)
            pending.append(mask)
            yield ids

    def masks():
        while pending:
            yield pending.popleft()

    meta = _write(out, covering(tok, documents(), jsonl), tok, masks=masks())
    meta["notes"] = [] if tok.eos_id is not None else [
        "the tokenizer has no end-of-text token, so no EOS closes an example"]
    return meta


@exits_on_user_error
def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jaxtron.data.prepare",
                                     description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--input", help="pretraining text: folder, text file or .jsonl file")
    source.add_argument("--jsonl", help="fine-tuning examples, one JSON object a line")
    parser.add_argument("--out", required=True, help="output prefix (writes .bin/.idx/.json)")
    parser.add_argument("--tokenizer", default="byte",
                        help="'byte' or a Hugging Face tokenizer.json")
    parser.add_argument("--glob", default="*", help="file pattern inside a folder input")
    parser.add_argument("--jsonl-key", default="text", help="field holding text in JSONL")
    parser.add_argument("--prompt-key", help="--jsonl: field of the untrained prompt "
                                             "(default prompt)")
    parser.add_argument("--completion-key", help="--jsonl: field of the trained completion "
                                                 "(default completion)")
    parser.add_argument("--messages-key", help="--jsonl: field of a chat's list of "
                                               "{role, content} turns (assistant turns trained)")
    parser.add_argument("--encoding", default="utf-8",
                        help="encoding of the input text (undecodable bytes are replaced and "
                             "counted)")
    args = parser.parse_args(argv)
    sft_flags = [f"--{name.replace('_', '-')}" for name in
                 ("prompt_key", "completion_key", "messages_key") if getattr(args, name)]
    if args.input is not None:
        if sft_flags:
            raise DataError(f"{sft_flags[0]} applies to fine-tuning examples; pass them with "
                            "--jsonl instead of --input.")
        meta = prepare(args.input, args.out, args.tokenizer, args.glob, args.jsonl_key,
                       args.encoding)
    else:
        if args.messages_key and (args.prompt_key or args.completion_key):
            raise DataError("--messages-key reads chats, --prompt-key/--completion-key "
                            "prompt/completion pairs; pass one form only.")
        meta = prepare_sft(args.jsonl, args.out, args.tokenizer,
                           args.prompt_key or "prompt", args.completion_key or "completion",
                           args.messages_key, args.encoding)
    notes = "".join(f"; {note}" for note in meta["notes"])
    trained = (f" ({meta['num_trained_tokens']} trained)" if meta.get("loss_mask") else "")
    print(f"wrote {args.out}.bin/.idx{'/.mask.bin' if meta.get('loss_mask') else ''}: "
          f"{meta['num_documents']} documents, {meta['num_tokens']} tokens{trained}, "
          f"vocab {meta['vocab_size']}{notes}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
