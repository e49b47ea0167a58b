"""Fine-tuning data: prompt/completion and chat JSONL become documents plus a loss mask
(`PREFIX.mask.bin`) that marks exactly the trained tokens; bad lines are one-line errors."""

import json
import subprocess
import sys

import numpy as np
import pytest

from jaxtron.data import prepare
from jaxtron.data.indexed import IndexedDataset, write_indexed
from jaxtron.data.prepare import prepare_sft
from jaxtron.errors import DataError

EOS = 0  # the byte tokenizer's


def write_jsonl(path, records):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n"
                            for r in records))
    return path


def fails_with_one_line(capsys, argv, *fragments):
    assert prepare.main(argv) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def test_prompt_completion_mask_marks_the_completion_and_eos(tmp_path):
    examples = [{"prompt": "Q: 2+2?\nA: ", "completion": "4"},
                {"prompt": "", "completion": "only completion"},
                {"prompt": "Translate 'café': ", "completion": "coffee shop", "id": 7}]
    path = write_jsonl(tmp_path / "pc.jsonl", examples[:2] + [""] + examples[2:])  # blank line
    meta = prepare_sft(path, tmp_path / "pc")
    ds = IndexedDataset(tmp_path / "pc")
    tokens, mask = [], []
    for ex in examples:  # the same by hand: bytes, prompt untrained, completion and EOS trained
        prompt, completion = ex["prompt"].encode(), ex["completion"].encode()
        tokens += [*prompt, *completion, EOS]
        mask += [0] * len(prompt) + [1] * len(completion) + [1]
    assert list(ds.tokens) == tokens
    assert isinstance(ds.loss_mask, np.memmap) and ds.loss_mask.dtype == np.uint8
    assert list(ds.loss_mask) == mask
    assert not ds.loss_mask.flags.writeable
    assert ds.num_documents == meta["num_documents"] == 3
    assert ds.meta["loss_mask"] is True and meta["num_trained_tokens"] == sum(mask)


def test_custom_keys_through_the_cli(tmp_path, capsys):
    path = write_jsonl(tmp_path / "qa.jsonl", [{"q": "hi ", "a": "yo"}])
    out = tmp_path / "qa"
    assert prepare.main(["--jsonl", str(path), "--prompt-key", "q", "--completion-key", "a",
                         "--out", str(out)]) == 0
    assert "1 documents, 6 tokens (3 trained)" in capsys.readouterr().out
    ds = IndexedDataset(out)
    assert bytes(ds.tokens[:-1].astype(np.uint8)) == b"hi yo"
    assert list(ds.loss_mask) == [0, 0, 0, 1, 1, 1]


def test_chat_trains_only_assistant_turns(tmp_path):
    turns = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"},
             {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Bye"},
             {"role": "assistant", "content": "Ciao"}]
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": turns}])
    prepare_sft(path, tmp_path / "chat", messages_key="messages")
    ds = IndexedDataset(tmp_path / "chat")
    text = ("<|system|>\nBe terse.\n<|user|>\nHi\n<|assistant|>\nHello\n<|user|>\nBye\n"
            "<|assistant|>\nCiao").encode()
    assert list(ds.tokens) == [*text, EOS]
    trained = bytes(t for t, m in zip(ds.tokens, ds.loss_mask) if m)
    assert trained == b"HelloCiao\0"
    # Each trained run is exactly an assistant turn's content (then the EOS).
    runs = np.split(np.flatnonzero(ds.loss_mask), np.flatnonzero(np.diff(
        np.flatnonzero(ds.loss_mask)) > 1) + 1)
    assert [bytes(ds.tokens[r].astype(np.uint8)) for r in runs] == [b"Hello", b"Ciao\0"]


def test_hugging_face_tokenizer_adds_special_tokens_once(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(["hello world", "hello jax world"] * 20, trainers.BpeTrainer(
        vocab_size=60, special_tokens=["<unk>", "<s>", "</s>"]))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A",
                                                       special_tokens=[("<s>", 1)])
    tok.save(str(tmp_path / "tokenizer.json"))
    path = write_jsonl(tmp_path / "pc.jsonl", [{"prompt": "hello", "completion": "jax world"}])
    prepare_sft(path, tmp_path / "hf", tokenizer=str(tmp_path / "tokenizer.json"))
    ds = IndexedDataset(tmp_path / "hf")
    prompt = tok.encode("hello").ids
    completion = tok.encode("jax world", add_special_tokens=False).ids
    assert prompt[0] == 1 and 1 not in completion
    assert list(ds.tokens) == prompt + completion + [tok.token_to_id("</s>")]
    assert list(ds.loss_mask) == [0] * len(prompt) + [1] * (len(completion) + 1)


GOOD = {"prompt": "p", "completion": "c"}


@pytest.mark.parametrize("lines, extra, fragments", [
    ([GOOD, '{"prompt": "p", "completion": '], [], ("line 2 is not valid JSON",)),
    ([GOOD, GOOD, {"prompt": "p"}], [], ("line 3 has no 'completion' field",
                                         "--completion-key")),
    ([{"completion": "c"}], [], ("line 1 has no 'prompt' field", "--prompt-key")),
    ([GOOD, {"prompt": "p", "completion": ""}], [], ("line 2 has an empty 'completion'",)),
    ([{"prompt": "p", "completion": 3}], [], ("line 1 field 'completion' is a JSON number",)),
    (['["p", "c"]'], [], ("line 1 holds a JSON list, not an object",)),
    ([GOOD], ["--messages-key", "messages"], ("line 1 has no 'messages' field",
                                              "--messages-key")),
    ([{"messages": [{"role": "user", "content": "hi"}]}], ["--messages-key", "messages"],
     ("line 1 field 'messages' has no 'assistant' turn",)),
    ([{"messages": [{"role": "user", "content": "hi"}, {"content": "yo"}]}],
     ["--messages-key", "messages"], ("line 1 turn messages[1] has no 'role'",)),
    ([{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant"}]}],
     ["--messages-key", "messages"], ("line 1 turn messages[1] has no 'content'",)),
    ([{"messages": []}], ["--messages-key", "messages"], ("must be a non-empty list",)),
    ([""], [], ("holds no examples",)),
])
def test_bad_lines_give_one_line_errors(tmp_path, capsys, lines, extra, fragments):
    path = write_jsonl(tmp_path / "bad.jsonl", lines)
    fails_with_one_line(capsys, ["--jsonl", str(path), "--out", str(tmp_path / "o"), *extra],
                        str(path), *fragments)


def test_a_failed_prepare_leaves_the_older_dataset_whole(tmp_path):
    good = write_jsonl(tmp_path / "good.jsonl", [GOOD, GOOD])
    prepare_sft(good, tmp_path / "d")
    bad = write_jsonl(tmp_path / "bad.jsonl", [GOOD, {"prompt": "x"}])
    with pytest.raises(DataError, match="line 2 has no 'completion' field"):
        prepare_sft(bad, tmp_path / "d")
    ds = IndexedDataset(tmp_path / "d")
    assert ds.num_documents == 2 and list(ds.loss_mask) == [0, 1, 1] * 2
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("d.")) == [
        "d.bin", "d.idx", "d.json", "d.mask.bin"]


def test_the_cli_exits_non_zero_with_one_line(tmp_path):
    path = write_jsonl(tmp_path / "bad.jsonl", [GOOD, GOOD, GOOD, '{"prompt": "p"'])
    result = subprocess.run([sys.executable, "-m", "jaxtron.data.prepare", "--jsonl", str(path),
                             "--out", str(tmp_path / "o")], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and f"{path} line 4 is not valid JSON" in lines[0], result.stderr


@pytest.mark.parametrize("argv, fragment", [
    (["--input", "x.jsonl", "--prompt-key", "q"], "--prompt-key applies to fine-tuning"),
    (["--jsonl", "x.jsonl", "--messages-key", "m", "--completion-key", "a"], "one form only"),
])
def test_flags_of_the_other_mode(tmp_path, capsys, argv, fragment):
    fails_with_one_line(capsys, [*argv, "--out", str(tmp_path / "o")], fragment)


def test_mask_file_round_trips_and_is_checked(tmp_path):
    docs = [[5, 6, 7], [8, 9], [10]]
    masks = [[0, 1, 1], [1, 0], [0]]
    meta = write_indexed(tmp_path / "m", docs, masks=masks, vocab_size=256, tokenizer="byte",
                         eos_id=EOS)
    ds = IndexedDataset(tmp_path / "m")
    assert ds.loss_mask.shape == ds.tokens.shape
    assert list(ds.loss_mask) == [0, 1, 1, 1, 1, 0, 1, 0, 1]  # each EOS trained
    assert (tmp_path / "m.mask.bin").read_bytes() == bytes(ds.loss_mask)
    assert meta["loss_mask"] and meta["num_trained_tokens"] == 6

    write_indexed(tmp_path / "m", docs, vocab_size=256, tokenizer="byte", eos_id=None)
    assert not (tmp_path / "m.mask.bin").exists()  # no stale mask for unmasked data
    assert IndexedDataset(tmp_path / "m").loss_mask is None

    write_indexed(tmp_path / "m", docs, masks=masks, vocab_size=256, tokenizer="byte",
                  eos_id=None)
    assert list(IndexedDataset(tmp_path / "m").loss_mask) == [0, 1, 1, 1, 0, 0]
    mask_file = tmp_path / "m.mask.bin"
    mask_file.write_bytes(mask_file.read_bytes()[:-1])
    with pytest.raises(DataError) as err:
        IndexedDataset(tmp_path / "m")
    assert str(err.value).count("\n") == 0
    assert f"{mask_file} holds 5 mask bytes but" in str(err.value) and "rebuild" in str(err.value)
    mask_file.unlink()
    with pytest.raises(DataError, match=r"says the dataset has a loss mask but .*m.mask.bin is "
                                        "missing"):
        IndexedDataset(tmp_path / "m")


@pytest.mark.parametrize("masks, fragment", [
    ([[0, 1], [1, 0], [0]], "masks item 0 for .* has 2 entries but its document has 3"),
    ([[0, 1, 2], [1, 0], [0]], "masks item 0 for .* holds values other than 0 and 1"),
    ([[0, 1, 1], [1, 0]], "masks for .* has 2 items but documents has more"),
    ([[0, 1, 1], [1, 0], [0], [1]], "masks for .* has more items than documents"),
])
def test_masks_must_match_the_documents(tmp_path, masks, fragment):
    with pytest.raises(DataError, match=fragment):
        write_indexed(tmp_path / "m", [[5, 6, 7], [8, 9], [10]], masks=masks, vocab_size=256,
                      tokenizer="byte", eos_id=EOS)
    assert not list(tmp_path.iterdir())  # nothing half-written left behind
