"""Hugging Face conversion against transformers itself: each folder of tests/hf_fixtures/ holds a
small random model saved by transformers (`scripts/hf_oracle_fixtures.py`), with the logits and
greedy continuation transformers computed for it. An import must give the same logits and ids,
and an export must give back the same tensors and a config.json that reads the same."""

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxtron.hf.files import load_hf_dir
from jaxtron.hf.translate import from_hf, to_hf
from jaxtron.models.generation import generate
from jaxtron.training.trainer import Trainer

from conftest import make_config

FIXTURES = Path(__file__).parent / "hf_fixtures"
FAMILIES = sorted(p.name for p in FIXTURES.iterdir() if (p / "oracle.json").is_file())
# Written by transformers for its own bookkeeping; nothing in them describes the model.
BOOKKEEPING = {"transformers_version", "dtype", "torch_dtype", "use_cache", "output_attentions",
               "output_hidden_states", "return_dict", "chunk_size_feed_forward",
               "is_encoder_decoder", "id2label", "label2id", "problem_type", "_name_or_path",
               "initializer_range", "attention_dropout", "output_router_logits",
               "pad_token_id", "bos_token_id", "eos_token_id", "architectures"}


# Fields an export writes otherwise, and why: DeepSeek-V3's config counts multi-token-prediction
# layers that transformers never builds nor saves; the export counts the layers it writes (0).
WRITTEN_OTHERWISE = {"num_nextn_predict_layers"}


def resolved(config: dict, key: str):
    """A field as transformers reads it: `head_dim: null` is hidden_size / num_attention_heads."""
    if key == "head_dim" and config[key] is None:
        return config["hidden_size"] // config["num_attention_heads"]
    return config[key]


def oracle(family: str) -> dict:
    return json.loads((FIXTURES / family / "oracle.json").read_text())


def imported(hf_config: dict, tensors: dict):
    """-> (trainer, model with the imported parameters, the parameters)."""
    model_fields, moe_fields, params = from_hf(hf_config, tensors)
    trainer = Trainer(make_config(model=model_fields, moe=moe_fields), devices=jax.devices()[:1])
    state = trainer.init_state()
    nnx.replace_by_pure_dict(state.params, params)
    return trainer, trainer.model(state), params


def logits_of(model, prompt: list[int]) -> np.ndarray:
    return np.asarray(jax.jit(lambda m, t: m(t))(model, jnp.asarray([prompt], jnp.int32)))[0]


def test_every_family_has_a_fixture_from_transformers_5():
    assert set(FAMILIES) >= {"llama-rope-scaling", "llama-tied", "qwen2", "qwen3",
                             "mistral-window", "mixtral", "qwen3-moe", "deepseek-v3"}
    assert all(oracle(f)["transformers"].startswith("5.") for f in FAMILIES)


@pytest.mark.parametrize("family", FAMILIES)
def test_import_computes_transformers_logits_and_greedy_ids(family):
    want = oracle(family)
    trainer, model, _ = imported(*load_hf_dir(FIXTURES / family))
    got = logits_of(model, want["prompt"])
    np.testing.assert_allclose(got, np.asarray(want["logits"]), rtol=1e-4, atol=1e-4)
    assert np.ptp(np.asarray(want["logits"])) > 1.0  # logits that differ, not a flat guess
    assert generate(model, want["prompt"], max_new_tokens=len(want["greedy"])) == want["greedy"]


@pytest.mark.parametrize("family", FAMILIES)
def test_export_gives_back_the_files_transformers_wrote(family):
    hf_config, tensors = load_hf_dir(FIXTURES / family)
    trainer, _, params = imported(hf_config, tensors)
    exported_config, exported = to_hf(trainer.config, params)
    assert exported.keys() == tensors.keys()
    for name, array in tensors.items():
        np.testing.assert_array_equal(exported[name], array, err_msg=name)
    # Every field both write agrees; the export reads back to the same model.
    shared = (exported_config.keys() & hf_config.keys()) - BOOKKEEPING - WRITTEN_OTHERWISE
    assert len(shared) >= 10, shared
    differ = {k: (exported_config[k], hf_config[k]) for k in shared
              if resolved(exported_config, k) != resolved(hf_config, k)}
    assert not differ, differ
    again = from_hf(json.loads(json.dumps(exported_config)), exported)
    assert again[:2] == from_hf(hf_config, tensors)[:2]  # the same model and MoE settings
    jax.tree.map(np.testing.assert_array_equal, again[2], params)


def test_a_misread_tensor_is_caught_by_the_oracle():
    """The comparison above can fail: rotary rows read in the other order (interleaved pairs
    instead of halves, the classic RoPE conversion bug) change the logits far past 1e-4."""
    family = "llama-rope-scaling"
    want = oracle(family)
    hf_config, tensors = load_hf_dir(FIXTURES / family)
    head_dim = hf_config["hidden_size"] // hf_config["num_attention_heads"]
    order = np.concatenate([np.arange(0, head_dim, 2), np.arange(1, head_dim, 2)])
    swapped = dict(tensors)
    for name in [n for n in tensors if n.endswith(("q_proj.weight", "k_proj.weight"))]:
        w = tensors[name]
        swapped[name] = w.reshape(-1, head_dim, w.shape[-1])[:, order].reshape(w.shape)
    _, model, _ = imported(hf_config, swapped)
    assert np.abs(logits_of(model, want["prompt"]) - np.asarray(want["logits"])).max() > 1e-2
