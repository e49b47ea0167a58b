"""Turn text into a Megatron-format token dataset (`PREFIX.bin`, `PREFIX.idx`, `PREFIX.json`).

    python -m jaxtron.data.prepare --input corpus/ --out data/mycorpus
    python -m jaxtron.data.prepare --input docs.jsonl --jsonl-key text --out data/docs \
        --tokenizer tokenizer.json

Input is a folder (every file under it whose name matches --glob, one document per file), a
single text file (one document), or a JSONL file (one document per line, text under
--jsonl-key). Then train with `data.path=PREFIX`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from jaxtron.data.indexed import write_indexed
from jaxtron.data.tokenizer import load_tokenizer
from jaxtron.errors import DataError, exits_on_user_error


def read_documents(path: Path, pattern: str, jsonl_key: str):
    if path.is_dir():
        files = sorted(p for p in path.rglob(pattern) if p.is_file())
        if not files:
            raise DataError(f"--input {path} has no files matching --glob {pattern!r}; pass a "
                            "--glob that matches its text files, e.g. '*.txt'.")
        for file in files:
            yield file.read_text(encoding="utf-8", errors="replace")
    elif path.suffix == ".jsonl":
        with open(path, encoding="utf-8") as f:
            for line_no, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as err:
                    raise DataError(f"{path} line {line_no} is not valid JSON ({err.msg}); fix "
                                    "or remove that line.") from None
                if not isinstance(record, dict) or jsonl_key not in record:
                    raise DataError(f"{path} line {line_no} has no {jsonl_key!r} field; pass "
                                    "--jsonl-key with the field that holds the text.")
                yield str(record[jsonl_key])
    elif path.is_file():
        yield path.read_text(encoding="utf-8", errors="replace")
    else:
        raise DataError(f"--input {path} does not exist; give a folder, a text file or a "
                        ".jsonl file.")


def prepare(input_path, out, tokenizer="byte", pattern="*", jsonl_key="text") -> dict:
    tok = load_tokenizer(tokenizer)
    docs = (tok.encode(text) for text in read_documents(Path(input_path), pattern, jsonl_key))
    return write_indexed(out, docs, vocab_size=tok.vocab_size, tokenizer=tok.name,
                         eos_id=tok.eos_id)


@exits_on_user_error
def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jaxtron.data.prepare",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--input", required=True, help="folder, text file or .jsonl file")
    parser.add_argument("--out", required=True, help="output prefix (writes .bin/.idx/.json)")
    parser.add_argument("--tokenizer", default="byte",
                        help="'byte' or a Hugging Face tokenizer.json")
    parser.add_argument("--glob", default="*", help="file pattern inside a folder input")
    parser.add_argument("--jsonl-key", default="text", help="field holding text in JSONL")
    args = parser.parse_args(argv)
    meta = prepare(args.input, args.out, args.tokenizer, args.glob, args.jsonl_key)
    print(f"wrote {args.out}.bin/.idx: {meta['num_documents']} documents, "
          f"{meta['num_tokens']} tokens, vocab {meta['vocab_size']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
