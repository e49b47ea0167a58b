"""Write the Hugging Face oracle fixtures: small random models of every family jaxtron converts,
saved by transformers itself, with their logits and greedy continuations computed by
transformers (torch, float32, eager attention).

    pip install 'jaxtron[oracle]'              # transformers and torch, CPU is enough
    python scripts/hf_oracle_fixtures.py       # rewrites tests/hf_fixtures/

Each family gets `tests/hf_fixtures/<family>/`: `config.json` and `model.safetensors` exactly as
`save_pretrained` writes them, and `oracle.json` with the prompt, the logits of every prompt
position, the greedy continuation, and the versions of transformers and torch that made them.
`tests/test_hf_oracle.py` imports each folder, compares jaxtron's logits and greedy ids with
these, and exports the model back to compare with the files. Run it again after a transformers
release to test against what that release writes.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
from pathlib import Path

import numpy as np
import torch
import transformers

OUT = Path(__file__).resolve().parent.parent / "tests" / "hf_fixtures"
PROMPT_LEN, NEW_TOKENS, VOCAB = 16, 8, 128
# Greedy ids are a fair test only where the best token leads the next one clearly.
MIN_MARGIN = 1e-2
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
              rms_norm_eps=1e-6, tie_word_embeddings=False)
FAMILIES = {
    # llama3 scaling with a short original context, so the three frequency bands all occur
    "llama-rope-scaling": ("LlamaForCausalLM", "LlamaConfig", dict(
        rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 16})),
    "llama-tied": ("LlamaForCausalLM", "LlamaConfig", dict(tie_word_embeddings=True)),
    "qwen2": ("Qwen2ForCausalLM", "Qwen2Config", {}),
    "qwen3": ("Qwen3ForCausalLM", "Qwen3Config", dict(head_dim=16)),
    # a window shorter than the prompt, so it masks keys
    "mistral-window": ("MistralForCausalLM", "MistralConfig", dict(sliding_window=6)),
    "mixtral": ("MixtralForCausalLM", "MixtralConfig", dict(
        num_local_experts=4, num_experts_per_tok=2, sliding_window=None)),
    "qwen3-moe": ("Qwen3MoeForCausalLM", "Qwen3MoeConfig", dict(
        head_dim=16, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])),
    # MLA, YaRN, a dense first layer, grouped routing and a non-zero correction bias
    "deepseek-v3": ("DeepseekV3ForCausalLM", "DeepseekV3Config", dict(
        num_hidden_layers=3, num_key_value_heads=4, moe_intermediate_size=24, q_lora_rank=24,
        kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12,
        n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, n_group=4,
        topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True, first_k_dense_replace=1,
        rope_interleave=True, rope_parameters={
            "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
            "original_max_position_embeddings": 16, "beta_fast": 32.0, "beta_slow": 1.0,
            "mscale": 1.0, "mscale_all_dim": 1.0})),
}


def randomise(model: torch.nn.Module, seed: int) -> None:
    """Every parameter and the routing bias drawn afresh at sizes that keep activations near 1,
    so that a swapped, transposed or mis-scaled tensor changes the logits clearly (transformers'
    own init, std 0.02, makes every logit nearly the same)."""
    gen = torch.Generator().manual_seed(seed)
    tensors = dict(model.named_parameters())
    tensors.update((name, b) for name, b in model.named_buffers()
                   if name.endswith("e_score_correction_bias"))
    with torch.no_grad():
        for name, tensor in sorted(tensors.items()):
            noise = torch.randn(tensor.shape, generator=gen, dtype=torch.float32)
            if name.endswith("norm.weight"):
                value = 1.0 + 0.1 * noise
            elif name.endswith(("bias", "e_score_correction_bias")):
                value = 0.1 * noise
            else:
                value = noise / math.sqrt(tensor.shape[-1])
            tensor.copy_(value.to(tensor.dtype))


def margins(model, ids: torch.Tensor) -> float:
    """The smallest gap between the best and second-best logit over the greedy steps."""
    logits = model(ids).logits[0, PROMPT_LEN - 1:-1]
    top = torch.topk(logits, 2, dim=-1).values
    return float((top[:, 0] - top[:, 1]).min())


def make(family: str, out: Path) -> dict:
    architecture, config_class, settings = FAMILIES[family]
    config = getattr(transformers, config_class)(**{**COMMON, **settings})
    config.architectures = [architecture]
    for seed in range(20):  # the first seed whose greedy steps are all clear-cut
        torch.manual_seed(seed)
        model = getattr(transformers, architecture)._from_config(
            config, attn_implementation="eager", torch_dtype=torch.float32).eval()
        randomise(model, seed)
        rng = np.random.default_rng(seed)
        prompt = torch.tensor(rng.integers(0, VOCAB, (1, PROMPT_LEN)))
        with torch.no_grad():
            logits = model(prompt).logits[0].numpy()
            greedy = model.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False,
                                    min_new_tokens=NEW_TOKENS, pad_token_id=0)
            margin = margins(model, greedy)
        if margin >= MIN_MARGIN:
            break
    else:
        raise SystemExit(f"{family}: no seed gives clear-cut greedy steps")
    if out.exists():
        shutil.rmtree(out)
    model.save_pretrained(out, safe_serialization=True)
    oracle = {"family": family, "seed": seed, "transformers": transformers.__version__,
              "torch": torch.__version__, "attention": "eager", "dtype": "float32",
              "prompt": prompt[0].tolist(), "greedy": greedy[0, PROMPT_LEN:].tolist(),
              "min_greedy_margin": margin, "logits": logits.tolist()}
    (out / "oracle.json").write_text(json.dumps(oracle) + "\n")
    return oracle


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=OUT, help="folder of the fixtures")
    parser.add_argument("families", nargs="*", default=list(FAMILIES),
                        help=f"families to write (default all: {', '.join(FAMILIES)})")
    args = parser.parse_args(argv)
    for family in args.families:
        if family not in FAMILIES:
            parser.error(f"unknown family {family}; choose from {', '.join(FAMILIES)}")
        oracle = make(family, args.out / family)
        print(f"{family}: seed {oracle['seed']}, greedy {oracle['greedy']}, margin "
              f"{oracle['min_greedy_margin']:.3f} (transformers {oracle['transformers']})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
