"""Weighted blends: proportions, one stream per seed, exact resume mid-blend, per-source loss."""

import numpy as np
import pytest
from test_checkpoint import whole_and_killed_runs

from jaxtron.config.loading import config_from_dict, config_to_dict
from jaxtron.data.indexed import write_indexed
from jaxtron.data.pipeline import eval_batches, open_sources, train_batches
from jaxtron.errors import ConfigError, DataError

from conftest import make_config, metric_records

SEQ = 16


def write_source(prefix, low: int, documents: int = 60, seed: int = 0):
    """A source whose token ids all lie in [low, low + 50): each row says where it came from."""
    rng = np.random.default_rng(seed)
    docs = [rng.integers(low, low + 50, rng.integers(5, 40)).tolist() for _ in range(documents)]
    write_indexed(prefix, docs, vocab_size=256, tokenizer="test", eos_id=low)
    return str(prefix)


@pytest.fixture()
def two_sources(tmp_path):
    return write_source(tmp_path / "a", 0), write_source(tmp_path / "b", 100, seed=1)


def blend_config(a, b, weights=(0.3, 0.7), **data):
    return make_config(data={"seq_len": SEQ, "workers": 0, "val_fraction": 0.1,
                             "blend": [{"path": a, "weight": weights[0], "name": "a"},
                                       {"path": b, "weight": weights[1], "name": "b"}],
                             **data})


def rows_from_a(batches, count):
    rows = np.concatenate([next(batches)["tokens"] for _ in range(count)])
    return rows, (rows.max(axis=1) < 100)


def test_each_source_gets_its_share_and_the_stream_is_the_seeds(two_sources):
    config = blend_config(*two_sources)
    sources = open_sources(config)
    rows, from_a = rows_from_a(train_batches(config, sources), 250)  # 2,000 rows of 8
    assert rows.shape[0] == 2000
    assert ((rows < 100).all(axis=1) | (rows >= 100).all(axis=1)).all()  # never mixed in a row
    sd = np.sqrt(2000 * 0.3 * 0.7)
    assert abs(from_a.sum() - 600) <= 3 * sd
    again, _ = rows_from_a(train_batches(config, sources), 250)
    np.testing.assert_array_equal(rows, again)
    other = blend_config(*two_sources)
    other = config_from_dict(config_to_dict(other), ["train.seed=1"])
    shuffled, _ = rows_from_a(train_batches(other, open_sources(other)), 250)
    assert not np.array_equal(rows, shuffled)


def test_megatron_string_form_is_the_same_blend(two_sources):
    a, b = two_sources
    listed = blend_config(a, b)
    text = make_config(data={"seq_len": SEQ, "workers": 0, "val_fraction": 0.1,
                             "blend": f"0.3 {a} 0.7 {b}"})
    assert [(s.path, s.weight) for s in text.data.sources] == \
        [(s.path, s.weight) for s in listed.data.sources]


def test_resume_mid_blend_continues_the_stream_and_notes_new_weights(two_sources, capsys):
    config = blend_config(*two_sources, packing="documents")
    sources = open_sources(config)
    stream = train_batches(config, sources)
    for _ in range(7):
        next(stream)
    state = stream.get_state()
    expected = [next(stream) for _ in range(3)]
    resumed = train_batches(config, sources)
    resumed.set_state(state)
    for want in expected:
        got = next(resumed)
        assert got.keys() == want.keys()
        for key in want:
            np.testing.assert_array_equal(got[key], want[key])
    assert "blend changed" not in capsys.readouterr().err
    changed = blend_config(*two_sources, weights=(0.5, 0.5), packing="documents")
    train_batches(changed, open_sources(changed)).set_state(state)
    assert "data blend changed on resume" in capsys.readouterr().err


def test_each_source_holds_out_its_own_documents(two_sources):
    config = blend_config(*two_sources)
    held_out = dict(eval_batches(config, open_sources(config)))
    assert set(held_out) == {"a", "b"}
    assert (held_out["a"][0]["tokens"] < 100).all() and (held_out["b"][0]["tokens"] >= 100).all()


def test_bad_blends_are_one_line_errors_naming_the_source(two_sources, tmp_path):
    a, _ = two_sources
    with pytest.raises(ConfigError, match=r"data.blend\[1\].weight=0.0 .* must be positive"):
        blend_config(a, a + "x", weights=(1.0, 0.0))
    config = blend_config(a, str(tmp_path / "missing"))
    with pytest.raises(DataError, match="missing has no .*missing.bin"):
        open_sources(config)


def test_kill_9_mid_blend_then_resume_reproduces_the_losses_bitwise(tmp_path):
    other = write_source(tmp_path / "other", 40, documents=400)
    blend = ["data.blend=0.6 builtin:stdlib 0.4 " + other, "data.packing=documents",
             "data.eod_mask_loss=true", "train.steps=8", "checkpoint.every=3",
             "train.eval_every=4", "train.eval_batches=1"]
    whole, killed = whole_and_killed_runs(tmp_path, blend, "step 5/8")
    whole_rows = {r["step"]: r for r in metric_records(whole)}
    killed_rows = {r["step"]: r for r in metric_records(killed)}
    assert {s: r["loss"] for s, r in killed_rows.items()} == \
        {s: r["loss"] for s, r in whole_rows.items()}
    evaluated = whole_rows[8]
    assert {"eval_loss", "eval_loss/stdlib", "eval_loss/other"} <= evaluated.keys()
    assert evaluated["eval_loss"] == pytest.approx(
        0.6 * evaluated["eval_loss/stdlib"] + 0.4 * evaluated["eval_loss/other"])
    assert all(r["data_wait_s"] >= 0 for r in whole_rows.values())
