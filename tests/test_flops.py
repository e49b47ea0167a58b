from jaxtron.flops import matmul_params, training_flops_per_token

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
    from jaxtron import config as config_lib
    m = config_lib.load("configs/gpt2-124m.yaml").model
    # 85M non-embedding matmul weights (12 * 12 * 768^2) plus the tied 768 x 50304 head.
    assert matmul_params(m) == 12 * 12 * 768 * 768 + 768 * 50304
