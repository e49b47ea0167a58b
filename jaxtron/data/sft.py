"""Fine-tuning (SFT) examples from JSONL: token ids plus a loss mask of what is trained.

Two line shapes, one example (one document) per line:

* prompt/completion: `{"prompt": "...", "completion": "..."}`. The prompt's and the
  completion's tokens are concatenated as they are (add any separator to the text yourself);
  the completion's tokens and the closing EOS are trained, the prompt's are not.
* chat: `{"messages": [{"role": "user", "content": "..."}, ...]}`. Each turn is rendered as
  a role header and its content, turns after the first preceded by a newline:

      <|system|>\\nYou are terse.\\n<|user|>\\nHi\\n<|assistant|>\\nHello

  then EOS. Only the content of `assistant` turns and the final EOS are trained; headers,
  separators and every other role's content are context. To generate, render the
  conversation the same way up to `\\n<|assistant|>\\n` and sample until EOS.

The pieces are tokenised separately, so the mask falls exactly on their boundaries; only the
first piece gets the tokenizer's special tokens (a BOS, if it adds one).
"""

from __future__ import annotations

import difflib
import json
from pathlib import Path

from jaxtron.errors import DataError

ASSISTANT = "assistant"
# The roles chat templates know (OpenAI's and Hugging Face's): a misspelt assistant turn would
# otherwise be read as context and silently left untrained.
ROLES = ("system", "developer", "user", ASSISTANT, "tool")


def json_type(value) -> str:
    """The JSON name of a parsed value's type, as the user wrote it."""
    names = {str: "string", bool: "boolean", int: "number", float: "number", list: "array",
             dict: "object", type(None): "null"}
    return names.get(type(value), type(value).__name__)


def role_header(role: str, first: bool) -> str:
    """The untrained text before a turn's content: `<|role|>` on its own line."""
    return ("" if first else "\n") + f"<|{role}|>\n"


def jsonl_records(path: Path, encoding: str = "utf-8"):
    """(line number, parsed JSON object) of each non-blank line of a JSONL file."""
    try:
        f = open(path, "rb")
    except OSError as err:
        raise DataError(f"cannot read {path} ({err.strerror}); give an existing .jsonl file "
                        "you can read.") from None
    with f:
        for line_no, raw in enumerate(f, 1):
            try:
                line = raw.decode(encoding)
            except UnicodeDecodeError as err:
                raise DataError(f"{path} line {line_no} is not {encoding} text (byte "
                                f"{err.start}); fix that line or pass --encoding.") from None
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise DataError(f"{path} line {line_no} is not valid JSON ({err.msg}); fix "
                                "or remove that line.") from None
            if not isinstance(record, dict):
                raise DataError(f"{path} line {line_no} holds a JSON {type(record).__name__}, "
                                "not an object; write one JSON object per line.")
            yield line_no, record


def _text(record: dict, key: str, where: str, flag: str) -> str:
    if key not in record:
        raise DataError(f"{where} has no {key!r} field; pass {flag} with the field that holds "
                        "it, or fix that line.")
    value = record[key]
    if not isinstance(value, str):
        raise DataError(f"{where} field {key!r} is a JSON {json_type(value)}, not a "
                        "string; fix that line.")
    return value


def prompt_completion(record: dict, prompt_key: str, completion_key: str,
                      where: str) -> list[tuple[str, bool]]:
    """[(text, trained)] of a prompt/completion line."""
    prompt = _text(record, prompt_key, where, "--prompt-key")
    completion = _text(record, completion_key, where, "--completion-key")
    if not completion:
        raise DataError(f"{where} has an empty {completion_key!r}; give it the text to train "
                        "on, or remove that line.")
    return [(prompt, False), (completion, True)]


def chat(record: dict, messages_key: str, where: str) -> list[tuple[str, bool]]:
    """[(text, trained)] of a chat line rendered with `role_header`."""
    if messages_key not in record:
        raise DataError(f"{where} has no {messages_key!r} field; pass --messages-key with the "
                        "field that holds the turns, or fix that line.")
    turns = record[messages_key]
    if not isinstance(turns, list) or not turns:
        raise DataError(f"{where} field {messages_key!r} must be a non-empty list of "
                        "{role, content} turns; fix that line.")
    pieces, trained = [], False
    for number, turn in enumerate(turns):
        field = f"{messages_key}[{number}]"
        if not isinstance(turn, dict) or not isinstance(turn.get("role"), str) or not turn["role"]:
            raise DataError(f"{where} turn {field} has no 'role' string; give every turn a "
                            "role and a content.")
        if not isinstance(turn.get("content"), str):
            raise DataError(f"{where} turn {field} has no 'content' string; give every turn a "
                            "role and a content.")
        role, content = turn["role"], turn["content"]
        if role not in ROLES:
            close = difflib.get_close_matches(role, ROLES, n=1, cutoff=0.5)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise DataError(f"{where} turn {field} has role {role!r}, which no chat template "
                            f"knows; {hint}use one of {', '.join(ROLES)}.")
        is_assistant = role == ASSISTANT
        trained = trained or (is_assistant and bool(content))
        pieces += [(role_header(role, number == 0), False), (content, is_assistant)]
    if not trained:
        raise DataError(f"{where} field {messages_key!r} has no {ASSISTANT!r} turn with "
                        "content, so nothing would be trained; add one or remove that line.")
    return pieces


def tokenize(tok, pieces: list[tuple[str, bool]]) -> tuple[list[int], list[int]]:
    """Token ids and their 0/1 loss mask (EOS not included: write_indexed appends it)."""
    ids, mask = [], []
    for text, trained in pieces:
        if not text:
            continue
        part = tok.encode(text, add_special_tokens=not ids)
        ids += part
        mask += [int(trained)] * len(part)
    return ids, mask


def read_examples(path: Path, *, prompt_key: str = "prompt", completion_key: str = "completion",
                  messages_key: str | None = None, encoding: str = "utf-8"):
    """[(text, trained)] pieces of every example in a JSONL file, in order."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"--jsonl {path} does not exist; give the .jsonl file of examples.")
    count = 0
    for line_no, record in jsonl_records(path, encoding):
        where = f"{path} line {line_no}"
        if messages_key is not None:
            yield chat(record, messages_key, where)
        else:
            yield prompt_completion(record, prompt_key, completion_key, where)
        count += 1
    if not count:
        raise DataError(f"--jsonl {path} holds no examples (every line is blank); write one "
                        "JSON object per line.")
