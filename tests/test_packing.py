"""Packed documents and loss masks: a packed row trains exactly like its documents one by one.

The reference runs each document alone through the plain model (no segment ids, no positions,
no mask), so it shares none of the packing code it checks.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxtron.data.indexed import IndexedDataset, write_indexed
from jaxtron.data.windows import Windows
from jaxtron.training.trainer import Trainer

from conftest import initial_state, make_config

L = 32


def pack(rows_of_docs):
    """Rows of documents (token lists, each row L + 1 tokens in all) -> a packed batch with
    segment ids, positions and a loss mask without the cross-document predictions."""
    batch = {"tokens": [], "segment_ids": [], "positions": [], "loss_mask": []}
    for docs in rows_of_docs:
        tokens = np.concatenate(docs)
        assert tokens.size == L + 1
        seg = np.concatenate([np.full(len(d), i + 1) for i, d in enumerate(docs)])
        pos = np.concatenate([np.arange(len(d)) for d in docs])
        batch["tokens"].append(tokens)
        batch["segment_ids"].append(seg[:-1])
        batch["positions"].append(pos[:-1])
        batch["loss_mask"].append((seg[1:] == seg[:-1]).astype(np.float32))
    return {k: np.stack(v).astype(np.float32 if k == "loss_mask" else np.int32)
            for k, v in batch.items()}


def random_rows(rng, rows, vocab=256):
    """Rows of 1-3 documents of random lengths (at least 2 tokens each)."""
    out = []
    for _ in range(rows):
        count = rng.integers(1, 4)
        cuts = np.sort(rng.choice(np.arange(2, L - 1), size=count - 1, replace=False))
        lengths = np.diff(np.concatenate([[0], cuts, [L + 1]]))
        if (lengths < 2).any():
            lengths = np.array([L + 1])
        out.append([rng.integers(0, vocab, n) for n in lengths])
    return out


def one_by_one(model_params, graphdef, rows_of_docs):
    """(loss, grads) of the documents run alone: the token-weighted mean of their losses."""
    docs = [d for row in rows_of_docs for d in row]
    counted = sum(len(d) - 1 for d in docs)

    def loss(params):
        model = nnx.merge(graphdef, params)
        total = 0.0
        for d in docs:
            tokens = jnp.asarray(d, jnp.int32)[None]
            doc_loss, _ = model.loss(tokens[:, :-1], tokens[:, 1:])
            total = total + doc_loss * (len(d) - 1)
        return total / counted

    return jax.jit(jax.value_and_grad(loss))(model_params)


def packed_loss_and_grads(trainer, params, batch):
    objective, grads = trainer.loss_and_grads(params, trainer.put_batch(batch))
    return objective, trainer.to_model_params(grads)


LAYOUTS = {
    "xla": ({}, {}),
    "pallas": ({"attention_impl": "pallas"}, {}),
    "gpt2": ({"type": "gpt2", "num_kv_heads": None}, {}),
    "context_parallel": ({}, {"mesh": {"data": 2, "sequence": 4}}),
    "pipeline": ({}, {"mesh": {"stage": 2, "data": 2}, "pipeline": {"microbatches": 2}}),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_packed_rows_train_like_their_documents_one_by_one(name):
    model, sections = LAYOUTS[name]
    mesh = sections.get("mesh", {"data": 1})
    others = {k: v for k, v in sections.items() if k != "mesh"}
    config = make_config(model=model, mesh=mesh, train={"batch_size": 4},
                         data={"packing": "documents", "eod_mask_loss": True}, **others)
    trainer = Trainer(config, devices=jax.devices()[:int(np.prod(list(mesh.values())))])
    state = initial_state(trainer)
    rows = random_rows(np.random.default_rng(0), 4)
    objective, grads = packed_loss_and_grads(trainer, state.params, pack(rows))
    model_params = trainer.to_model_params(state.params)
    want, want_grads = one_by_one(model_params, trainer.graphdef, rows)
    np.testing.assert_allclose(objective, want, rtol=2e-5)
    for got, ref in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads), strict=True):
        np.testing.assert_allclose(got, ref, rtol=2e-4, atol=2e-6)


def test_a_masked_target_has_no_effect_and_accumulation_counts_tokens_globally():
    rng = np.random.default_rng(1)
    batch = pack(random_rows(rng, 8))
    # Uneven counts per microbatch: whole rows masked in some, none in others.
    batch["loss_mask"][[0, 5]] = 0.0
    batch["loss_mask"][2, : L // 2] = 0.0
    base = {"data": {"packing": "documents"}, "train": {"batch_size": 8}}
    one = Trainer(make_config(**base), devices=jax.devices()[:1])
    params = one.init_state().params
    loss, grads = one.loss_and_grads(params, one.put_batch(batch))

    perturbed = dict(batch, tokens=batch["tokens"].copy())
    masked = np.argwhere(batch["loss_mask"] == 0)
    for row, j in masked:  # change every target whose prediction does not count
        perturbed["tokens"][row, j + 1] = (perturbed["tokens"][row, j + 1] + 7) % 256
    # ...but not the inputs: restore the tokens the model reads
    perturbed["tokens"][:, :-1] = batch["tokens"][:, :-1]
    loss_p, grads_p = one.loss_and_grads(params, one.put_batch(perturbed))
    np.testing.assert_array_equal(loss, loss_p)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_p), strict=True):
        np.testing.assert_array_equal(a, b)

    # The same loss from the counted tokens alone, written out with numpy from the logits.
    model = one.model(one.init_state())
    logits = np.asarray(model(jnp.asarray(batch["tokens"][:, :-1]),
                              _layout(batch)), np.float64)
    logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1,
                                                                                 keepdims=True)) \
        - logits.max(-1, keepdims=True)
    nll = -np.take_along_axis(logp, batch["tokens"][:, 1:, None], -1)[..., 0]
    want = (nll * batch["loss_mask"]).sum() / batch["loss_mask"].sum()
    np.testing.assert_allclose(loss, want, rtol=1e-5)

    accumulated = Trainer(make_config(**base, optim={"grad_accum": 4}, mesh={"data": 2}),
                          devices=jax.devices()[:2])
    loss_a, grads_a = accumulated.loss_and_grads(params, accumulated.put_batch(batch))
    np.testing.assert_allclose(loss_a, loss, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(grads_a), jax.tree.leaves(grads), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-7)


def _layout(batch):
    from jaxtron.models.token_positions import TokenPositions
    return TokenPositions(positions=jnp.asarray(batch["positions"]),
                       segment_ids=jnp.asarray(batch["segment_ids"]))


def test_windows_mark_documents_positions_and_masks_from_the_files(tmp_path):
    rng = np.random.default_rng(2)
    docs = [rng.integers(1, 200, n).tolist() for n in (5, 40, 3, 17, 9, 30)]
    masks = [rng.integers(0, 2, len(d)).tolist() for d in docs]
    write_indexed(tmp_path / "d", docs, vocab_size=256, tokenizer="test", eos_id=0,
                  masks=masks)
    dataset = IndexedDataset(tmp_path / "d")
    flat, starts, mask = [], [], []
    for d, m in zip(docs, masks):  # what the files should say, in plain Python
        starts.append(len(flat))
        flat += d + [0]
        mask += m + [1]
    windows = Windows(dataset, 0, len(flat), 16, documents=True, eod_mask_loss=True)
    for i in range(len(windows)):
        row, begin = windows[i], 16 * i
        assert row["tokens"].tolist() == flat[begin:begin + 17]
        doc_of = [max(k for k, s in enumerate(starts) if s <= t) for t in
                  range(begin, begin + 17)]
        assert row["segment_ids"].tolist() == [d - doc_of[0] + 1 for d in doc_of[:-1]]
        assert row["positions"].tolist() == [t - max(starts[doc_of[j]], begin) for j, t in
                                             enumerate(range(begin, begin + 16))]
        assert row["loss_mask"].tolist() == [
            float(mask[t + 1] and doc_of[j] == doc_of[j + 1])
            for j, t in enumerate(range(begin, begin + 16))]


def test_fine_tuning_data_needs_document_packing(tmp_path):
    from jaxtron.data.pipeline import open_sources
    from jaxtron.errors import DataError
    write_indexed(tmp_path / "sft", [[5, 6, 7, 8]] * 40, vocab_size=256, tokenizer="test",
                  eos_id=0, masks=[[0, 0, 1, 1]] * 40)
    config = make_config(data={"path": str(tmp_path / "sft"), "seq_len": 8})
    with pytest.raises(DataError, match="fine-tuning data .* set data.packing=documents"):
        open_sources(config)
    packed = make_config(data={"path": str(tmp_path / "sft"), "seq_len": 8,
                               "packing": "documents"})
    assert open_sources(packed)[0].dataset.loss_mask is not None


def test_fine_tuning_rows_hold_whole_examples_padded(tmp_path, capsys):
    from jaxtron.data.windows import WholeExamples
    rng = np.random.default_rng(3)
    prompts = [rng.integers(1, 200, rng.integers(2, 9)).tolist() for _ in range(50)]
    completions = [rng.integers(1, 200, rng.integers(1, 6)).tolist() for _ in range(50)]
    prompts[7] = list(range(1, 30))  # longer than a row: cut to it
    write_indexed(tmp_path / "sft", [p + c for p, c in zip(prompts, completions)],
                  vocab_size=256, tokenizer="test", eos_id=0,
                  masks=[[0] * len(p) + [1] * len(c) for p, c in zip(prompts, completions)])
    dataset = IndexedDataset(tmp_path / "sft")
    rows = WholeExamples(dataset, 0, 50, 15)
    assert rows.truncated == 1
    whole = [(p + c + [0])[:16] for p, c in zip(prompts, completions)]
    trained = [([0] * len(p) + [1] * (len(c) + 1))[:16] for p, c in zip(prompts, completions)]
    placed = []
    for i in range(len(rows)):
        row, examples = rows[i], list(range(rows.rows[i], rows.rows[i + 1]))
        placed += examples
        tokens = sum((whole[k] for k in examples), [])
        assert len(tokens) <= 16 and (examples == [7] or len(tokens) + len(
            whole[examples[-1] + 1] if examples[-1] + 1 < 50 else []) > 16 or i == len(rows) - 1)
        segment = sum(([n] * len(whole[k]) for n, k in enumerate(examples, 1)), [])
        segment += [0] * (16 - len(segment))
        mask = sum((trained[k] for k in examples), []) + [0] * (16 - len(tokens))
        assert row["tokens"].tolist() == tokens + [0] * (16 - len(tokens))
        assert row["segment_ids"].tolist() == segment[:-1]
        assert row["positions"].tolist() == [
            j - segment.index(segment[j]) if segment[j] else 0 for j in range(15)]
        # a target counts only inside its own example, after that example's prompt
        assert row["loss_mask"].tolist() == [
            float(mask[j + 1] and segment[j + 1] == segment[j] > 0) for j in range(15)]
    assert placed == list(range(50))
