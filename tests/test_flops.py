from jaxtron.training.flops import matmul_params, training_flops_per_token

from conftest import make_config


def test_flops_per_token_matches_a_hand_count():
    # 2 layers, D=64, H=4, G=2, K=16, F=128, V=256, L=32, llama (SwiGLU: three D x F matrices).
    m = make_config().model
    q, kv, o = 64 * 4 * 16, 2 * 64 * 2 * 16, 4 * 16 * 64      # 4096, 4096, 4096
    mlp = 3 * 64 * 128                                         # 24576
    head = 64 * 256                                            # 16384
    params = 2 * (q + kv + o + mlp) + head                     # 90112
    assert matmul_params(m) == params == 90112
    # Causal attention: position i attends to i + 1 keys; summed over L = 32 positions that is
    # 32 * 33 / 2 = 528 key positions, so (L + 1) / 2 = 16.5 per token, each costing
    # 2 (qk and pv) * H * K = 128 multiply-adds = 256 FLOPs forward, x3 for training, x2 layers.
    attention = 2 * 3 * 256 * 16.5
    assert training_flops_per_token(m, 32) == 6 * 90112 + attention == 566016


def test_gpt2_small_parameter_count_is_the_published_one():
    from jaxtron.config.loading import load_config
    m = load_config("configs/gpt2-124m.yaml").model
    # 85M non-embedding matmul weights (12 * 12 * 768^2) plus the tied 768 x 50304 head.
    assert matmul_params(m) == 12 * 12 * 768 * 768 + 768 * 50304


def test_recompute_adds_the_forward_matmuls_each_policy_repeats():
    from jaxtron.training.flops import hardware_flops_per_token

    base = make_config()
    model = training_flops_per_token(base.model, 32)
    attention_forward = 2 * 256 * 16.5          # both layers' forward, from the hand count above
    blocks = 90112 - 64 * 256                   # matmul weights outside the head

    def hardware(policy, platform="cpu"):
        return hardware_flops_per_token(make_config(model={"remat": policy}), platform)

    assert hardware("none") == model
    # save_dots keeps weight-matmul outputs and the blockwise kernel's named output...
    assert hardware("save_dots") == model
    # ...but cuDNN's (attention_impl auto on a GPU) has no name: its forward runs again.
    assert hardware("save_dots", "gpu") == model + attention_forward
    # full repeats every block's forward: weights (2 FLOPs per weight) and attention.
    assert hardware("full") == model + 2 * blocks + attention_forward
