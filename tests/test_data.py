import json
import struct

import numpy as np
import pytest

from jaxtron.data.indexed import MAGIC, IndexedDataset, write_indexed
from jaxtron.data.pipeline import eval_batches, open_dataset, split_point, train_batches
from jaxtron.data.prepare import prepare
from jaxtron.errors import DataError

from conftest import make_config, run_in_process


def write_corpus(folder, count=30):
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(count):
        (folder / f"doc{i:02d}.txt").write_text(f"document {i}: " + "lorem ipsum " * (i + 5))
    return folder


def test_prepare_folder_writes_megatron_index(tmp_path):
    corpus = write_corpus(tmp_path / "corpus", 3)
    meta = prepare(corpus, tmp_path / "out" / "toks")
    ds = IndexedDataset(tmp_path / "out" / "toks")
    raw = (tmp_path / "out" / "toks.idx").read_bytes()
    assert raw[:9] == MAGIC and struct.unpack("<Q", raw[9:17])[0] == 1 and raw[17] == 8
    assert ds.num_documents == meta["num_documents"] == 3
    texts = sorted(p.read_text() for p in corpus.iterdir())
    for i, text in enumerate(texts):
        start, end = ds.document_start(i), ds.document_start(i + 1)
        doc = bytes(int(t) for t in ds.tokens[start:end - 1]).decode()  # last token is EOS (0)
        assert doc == text and ds.tokens[end - 1] == 0


def test_prepare_jsonl_with_a_hugging_face_tokenizer(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(["hello world", "hello jax world"] * 20, trainers.BpeTrainer(
        vocab_size=60, special_tokens=["<unk>", "</s>"]))
    tok.save(str(tmp_path / "tokenizer.json"))
    lines = [json.dumps({"text": "hello world"}), json.dumps({"text": "hello jax"})]
    (tmp_path / "docs.jsonl").write_text("\n".join(lines) + "\n")
    result = run_in_process("jaxtron.data.prepare", "--input", str(tmp_path / "docs.jsonl"),
                            "--out", str(tmp_path / "hf"),
                            "--tokenizer", str(tmp_path / "tokenizer.json"))
    assert result.returncode == 0, result.stderr
    ds = IndexedDataset(tmp_path / "hf")
    eos = tok.token_to_id("</s>")
    expected = tok.encode("hello world").ids + [eos] + tok.encode("hello jax").ids + [eos]
    assert list(ds.tokens) == expected
    assert ds.vocab_size == tok.get_vocab_size()


def test_bad_inputs_give_clear_errors(tmp_path):
    (tmp_path / "bad.jsonl").write_text('{"body": "x"}\n')
    with pytest.raises(DataError, match="has no 'text' field; pass --jsonl-key"):
        prepare(tmp_path / "bad.jsonl", tmp_path / "x")
    prepare(write_corpus(tmp_path / "c", 3), tmp_path / "ok")
    with open(tmp_path / "ok.bin", "r+b") as f:
        f.truncate(10)
    with pytest.raises(DataError, match="truncated or mismatched"):
        IndexedDataset(tmp_path / "ok")
    with pytest.raises(DataError, match="has no .*missing.bin; create the dataset"):
        IndexedDataset(tmp_path / "missing")


def test_model_vocab_must_cover_the_data(tmp_path):
    prepare(write_corpus(tmp_path / "c"), tmp_path / "toks")
    config = make_config({"data.path": str(tmp_path / "toks"), "model.vocab_size": 128})
    with pytest.raises(DataError, match="set model.vocab_size=256 or more"):
        open_dataset(config)


def take(iterator, n):
    return [next(iterator)["tokens"] for _ in range(n)]


def test_same_seed_same_batches_and_restore_resumes_exactly():
    config = make_config()
    ds = open_dataset(config)
    first = take(train_batches(config, ds), 4)
    again = take(train_batches(config, ds), 4)
    for a, b in zip(first, again):
        np.testing.assert_array_equal(a, b)
    other = take(train_batches(make_config({"train.seed": 1}), ds), 1)
    assert not np.array_equal(first[0], other[0])

    it = train_batches(config, ds)
    take(it, 2)
    state = it.get_state()
    expected = take(it, 2)
    resumed = train_batches(config, ds)
    resumed.set_state(state)
    for a, b in zip(expected, take(resumed, 2)):
        np.testing.assert_array_equal(a, b)


def test_batches_are_shifted_windows_of_the_training_split():
    config = make_config()
    ds = open_dataset(config)
    batch = next(train_batches(config, ds))["tokens"]
    assert batch.shape == (8, 33) and batch.dtype == np.int32
    cut = split_point(ds, config.data.val_fraction)
    flat = np.asarray(ds.tokens[:cut])
    for row in batch:  # every row is a contiguous slice of the training tokens
        starts = np.flatnonzero(flat[:-32] == row[0])
        assert any(np.array_equal(flat[s:s + 33], row) for s in starts)
    [(_, held_out)] = eval_batches(config, ds)
    assert len(held_out) == 2
    val = np.asarray(ds.tokens[cut:])
    assert np.array_equal(held_out[0]["tokens"][0], val[:33])


def test_hosts_read_disjoint_rows_that_form_the_global_batch():
    config = make_config()
    ds = open_dataset(config)
    single = take(train_batches(config, ds), 2)
    hosts = [take(train_batches(config, ds, slice(4 * p, 4 * p + 4)), 2) for p in range(2)]
    for step in range(2):
        assert hosts[0][step].shape[0] == 4
        np.testing.assert_array_equal(np.concatenate([h[step] for h in hosts]), single[step])


def test_prepare_skips_binary_files_and_reports_undecodable_bytes(tmp_path, capsys):
    from jaxtron.data import prepare
    from jaxtron.data.indexed import IndexedDataset

    folder = tmp_path / "in"
    folder.mkdir()
    (folder / "a.txt").write_text("plain text")
    (folder / "b.txt").write_bytes("café au lait".encode("latin-1"))  # not UTF-8
    (folder / "c.png").write_bytes(b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR")
    out = tmp_path / "d"
    assert prepare.main(["--input", str(folder), "--out", str(out)]) == 0
    line = capsys.readouterr().out
    assert "2 documents" in line and "skipped 1 binary files" in line
    assert "replaced 1 bytes that are not utf-8 in 1 documents" in line and "latin-1" in line
    assert prepare.main(["--input", str(folder), "--out", str(out), "--encoding",
                         "latin-1"]) == 0
    assert "replaced" not in capsys.readouterr().out
    data = IndexedDataset(out)
    second = data.tokens[data.document_start(1):data.document_start(2) - 1]  # less the EOS
    assert bytes(second.astype(np.uint8)).decode("utf-8") == "café au lait"
    assert data.meta["max_token_id"] == int(data.tokens.max())


def read_megatron_index(path):
    """The .idx fields as Megatron-LM's _IndexReader reads them."""
    raw = path.read_bytes()
    assert raw[:9] == MAGIC
    version, code, count, doc_count = struct.unpack("<QBQQ", raw[9:34])
    lengths = np.frombuffer(raw, np.int32, count, 34)
    pointers = np.frombuffer(raw, np.int64, count, 34 + 4 * count)
    docs = np.frombuffer(raw, np.int64, doc_count, 34 + 12 * count)
    return version, code, lengths, pointers, docs


def test_documents_of_several_sequences(tmp_path):
    # Megatron's --split-sentences layout: one .idx entry per sentence, grouped by document.
    documents = [[[1, 2, 3], [4, 5]], [[6]], [[7, 8], [], [9, 10, 11], [12]], [[], []], [[13]]]
    meta = write_indexed(tmp_path / "s", documents, vocab_size=256, tokenizer="byte", eos_id=0,
                         sequences_per_document=True)
    version, code, lengths, pointers, docs = read_megatron_index(tmp_path / "s.idx")
    # Empty sentences are dropped, EOS ends each document's last sentence, and an empty
    # document is just its EOS.
    assert version == 1 and code == 8
    assert list(lengths) == [3, 3, 2, 2, 3, 2, 1, 2]
    assert list(pointers) == [0, 6, 12, 16, 20, 26, 30, 32]  # bytes, uint16 tokens
    assert list(docs) == [0, 2, 3, 6, 7, 8]
    assert meta["num_documents"] == 5 and meta["num_sequences"] == 8

    ds = IndexedDataset(tmp_path / "s")
    assert ds.num_documents == 5
    expected = [0]  # by hand: each document's tokens plus its EOS
    for doc in documents:
        expected.append(expected[-1] + sum(len(s) for s in doc) + 1)
    offsets = ds.document_offsets()
    assert offsets.dtype == np.int64 and list(offsets) == expected == [0, 6, 8, 15, 16, 18]
    assert ds.document_offsets() is offsets  # computed once
    sequence_starts = set((pointers // 2).tolist())
    inside = sequence_starts - set(expected)  # sentence starts that are not document starts
    assert inside == {3, 10, 13}
    for i in range(ds.num_documents + 1):
        assert ds.document_start(i) == expected[i] and ds.document_start(i) not in inside
        if 0 < i:
            assert ds.tokens[ds.document_start(i) - 1] == 0  # a document ends in its EOS
    cut = split_point(ds, 0.4)  # the split holds out whole documents
    assert cut == expected[3]


def test_one_sequence_per_document_unchanged(tmp_path):
    write_indexed(tmp_path / "p", [[1, 2], [3], [4, 5, 6]], vocab_size=256, tokenizer="byte",
                  eos_id=None)
    _, _, lengths, pointers, docs = read_megatron_index(tmp_path / "p.idx")
    assert list(lengths) == [2, 1, 3] and list(pointers) == [0, 4, 6]
    assert list(docs) == [0, 1, 2, 3]
    ds = IndexedDataset(tmp_path / "p")
    assert ds.num_documents == 3 and list(ds.document_offsets()) == [0, 2, 3, 6]
    assert ds.loss_mask is None


def test_many_documents_offsets_are_vectorised(tmp_path):
    rng = np.random.default_rng(0)
    sizes = rng.integers(1, 4, 200_000)
    documents = [[[7] * int(n)] * 2 for n in sizes]
    write_indexed(tmp_path / "big", documents, vocab_size=256, tokenizer="byte", eos_id=0,
                  sequences_per_document=True)
    ds = IndexedDataset(tmp_path / "big")
    expected = np.concatenate([[0], np.cumsum(2 * sizes + 1)])
    np.testing.assert_array_equal(ds.document_offsets(), expected)
    assert ds.document_start(123_456) == expected[123_456]


@pytest.mark.parametrize("change, fragment", [
    (lambda d: d.__setitem__(0, 1), "document_indices from 1 to 8, not from 0"),
    (lambda d: d.__setitem__(-1, 7), "document_indices from 0 to 7, not from 0 to its 8"),
    (lambda d: d.__setitem__(2, 1), "document_indices that decrease at document 2 (2 then 1)"),
])
def test_malformed_document_indices(tmp_path, change, fragment):
    documents = [[[1, 2, 3], [4, 5]], [[6]], [[7, 8], [9, 10, 11], [12]], [[13], [14]]]
    write_indexed(tmp_path / "s", documents, vocab_size=256, tokenizer="byte", eos_id=0,
                  sequences_per_document=True)
    idx = tmp_path / "s.idx"
    raw = bytearray(idx.read_bytes())
    start = 34 + 12 * 8
    docs = np.frombuffer(raw, np.int64, 5, start).copy()
    change(docs)
    raw[start:start + 40] = docs.tobytes()
    idx.write_bytes(bytes(raw))
    with pytest.raises(DataError) as err:
        IndexedDataset(tmp_path / "s")
    message = str(err.value)
    assert "\n" not in message and str(idx) in message and fragment in message
    assert "rebuild it with python -m jaxtron.data.prepare" in message
