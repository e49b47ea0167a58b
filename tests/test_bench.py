"""Benchmarks: the attention kernels (`jaxtron.kernels.speed`) and the training step (`jaxtron.bench`)."""

import json
import subprocess
import sys

import pytest

from jaxtron.kernels.speed import MODES, attention_flops

from conftest import run_in_process


def test_flop_count_follows_the_flashattention_convention():
    full = attention_flops(1, 16, 1024, 128, causal=False, mode="fwd")
    assert full == 4 * 16 * 1024 ** 2 * 128
    assert attention_flops(1, 16, 1024, 128, causal=True, mode="fwd") == full / 2
    assert attention_flops(1, 16, 1024, 128, causal=False, mode="fwd+bwd") == 3.5 * full


def test_cpu_smoke_run_prints_a_table_and_a_json_line():
    # Tiny shapes: Pallas runs in interpret mode on CPU, one grid step at a time. The timeout
    # turns a hang into a failure rather than a stuck suite.
    result = run_in_process("jaxtron.kernels.speed", "--seq-lens", "128,256",
                            "--impls", "xla,cudnn,pallas", "--heads", "2", "--kv-heads", "1",
                            "--head-dim", "32", "--warmup", "1", "--iters", "1", "--repeats",
                            "1", "--json")
    assert result.returncode == 0, result.stderr[-2000:]
    lines = result.stdout.strip().splitlines()
    report = json.loads(lines[-1])
    assert "pallas/xla" in result.stdout and "cudnn skipped" in result.stdout
    assert report["impls"] == ["xla", "pallas"]
    cells = {(r["seq_len"], r["mode"], r["impl"]): r for r in report["results"]}
    assert set(cells) == {(n, m, i) for n in (128, 256) for m in MODES for i in ("xla", "pallas")}
    heads, head_dim = 2, 32
    for (seq_len, mode, _), r in cells.items():
        # FlashAttention's count: q.k and p.v, 2 L^2 K FLOPs per head each, half of them masked
        # (causal); the backward's five matmuls make forward + backward 3.5 forwards.
        forward = 2 * (2 * heads * seq_len * seq_len * head_dim) / 2
        assert r["flops"] == (forward if mode == "fwd" else 3.5 * forward), r
        assert r["tflops"] == pytest.approx(r["flops"] / (r["ms"] / 1e3) / 1e12, rel=1e-9), r


def test_training_benchmark_reports_every_field_from_the_shared_flops_formula():
    from jaxtron import bench
    from jaxtron.config.loading import load_config
    from jaxtron.training.flops import hardware_flops_per_token, training_flops_per_token

    overrides = ["model.num_layers=2", "model.d_model=64", "model.mlp_dim=128",
                 "data.seq_len=32", "train.batch_size=8", "model.remat=full"]
    result = run_in_process("jaxtron.bench", "--config", "configs/tiny.yaml", *overrides,
                            "--warmup", "1", "--steps", "2", "--repeats", "1", "--json")
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert set(bench.FIELDS) <= report.keys()
    config = load_config("configs/tiny.yaml", overrides)
    assert report["flops_per_token"] == training_flops_per_token(config.model, 32, config.moe)
    assert report["hardware_flops_per_token"] == hardware_flops_per_token(config)
    model, hardware, weights = benchmarked_model_by_hand()
    assert (report["flops_per_token"], report["hardware_flops_per_token"]) == (model, hardware)
    # every rate is the batch's 8 x 32 tokens over the one measured step time
    tokens_per_s = 8 * 32 / report["step_s"]
    assert report["tokens_per_s"] == pytest.approx(tokens_per_s, rel=1e-9)
    assert report["model_tflops_per_device"] == pytest.approx(
        model * tokens_per_s / 8 / 1e12, rel=1e-9)
    assert report["mfu"] == pytest.approx(model * tokens_per_s / report["peak_flops"], rel=1e-9)
    assert report["hfu"] == pytest.approx(
        hardware * tokens_per_s / report["peak_flops"], rel=1e-9)
    assert report["overhead_ratio"] == pytest.approx(
        report["plain_tokens_per_s"] / report["jaxtron_one_device_tokens_per_s"], rel=1e-9)
    assert report["params_bytes_per_device"] == 4 * weights  # fp32, replicated (data only)
    assert report["devices"] == 8
    assert "jaxtron/plain step time" in result.stdout


def benchmarked_model_by_hand():
    """FLOPs per token of the benchmarked model (2 Llama layers, d 64, 4 query heads and 2 kv
    heads of 16, MLP 128, vocab 256, 32 tokens), without and with full remat, and its parameter
    count. A matmul costs 2 FLOPs per weight forward and twice that backward."""
    d, heads, kv_heads, k, mlp, vocab, layers, seq = 64, 4, 2, 16, 128, 256, 2, 32
    block = 2 * d * heads * k + 2 * d * kv_heads * k + 3 * d * mlp  # q, o; k, v; gate, up, down
    # q.k and p.v, 2 H K FLOPs per attended key each, over (L + 1) / 2 keys on average (causal)
    attention = layers * 2 * (2 * heads * k) * (seq + 1) / 2
    forward = 2 * (layers * block + d * vocab) + attention  # the embedding lookup is no matmul
    model = 3 * forward
    hardware = model + 2 * layers * block + attention  # remat runs each block forward again
    weights = layers * (block + 2 * d) + d + 2 * d * vocab  # norms; untied embed and head
    return model, hardware, weights


def test_plain_reference_model_gives_jaxtrons_loss_with_the_same_weights():
    # The overhead baseline must be the same model: independent code, same numbers.
    import jax
    import numpy as np
    from flax import nnx

    from jaxtron import bench
    from jaxtron.config.loading import load_config
    from jaxtron.training import plain_llama
    from jaxtron.training.trainer import Trainer

    config = load_config("configs/tiny.yaml", ["model.num_layers=2", "model.d_model=64",
                                               "model.mlp_dim=128", "data.seq_len=32",
                                               "train.batch_size=4", "mesh.data=1"])
    trainer = Trainer(config, jax.devices()[:1])
    state = trainer.init_state()
    ours = {"/".join(path): np.asarray(v.get_value())
            for path, v in nnx.to_flat_state(state.params)}
    n, d = config.model.num_layers, config.model.d_model
    layers = {"attn_norm": "attn_norm/scale", "mlp_norm": "mlp_norm/scale", "wk": "attn/wk",
              "wv": "attn/wv", "wq": "attn/wq", "wo": "attn/wo", "gate": "mlp/w_gate",
              "up": "mlp/w_up", "down": "mlp/w_down"}
    params = {"embed": ours["embedder/embed"], "final_norm": ours["head/final_norm/scale"],
              "head": ours["head/lm_head"],
              "layers": {k: ours[f"blocks/{v}"] for k, v in layers.items()}}
    for name in ("wq", "wk", "wv"):
        params["layers"][name] = params["layers"][name].reshape(n, d, -1)
    params["layers"]["wo"] = params["layers"]["wo"].reshape(n, -1, d)
    tokens = bench.random_tokens(config)
    expected = float(trainer.eval_loss(state, trainer.put_batch({"tokens": tokens})))
    got = float(plain_llama.loss_fn(params, tokens, config))
    assert got == pytest.approx(expected, rel=1e-5)


def test_gpu_check_records_every_gpu_test_and_passes_when_they_skip(tmp_path):
    """The GPU acceptance run's plumbing, on CPU: its tests part runs pytest -m gpu, whose tests
    skip here with a reason, and the JSON lists each of them."""
    out = tmp_path / "gpu_check.json"
    command = [sys.executable, "-m", "jaxtron.gpu_check", "--parts", "tests", "--out", str(out)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["environment"]["platform"] == "cpu"
    tests = report["tests"]
    assert tests["returncode"] == 0 and tests["skipped"] == len(tests["cases"]) >= 10
    assert all("GPU" in case["message"] for case in tests["cases"])


def test_schedules_are_timed_side_by_side_with_their_tables_bubbles():
    import jax

    from jaxtron import bench
    from jaxtron.config.loading import config_from_dict, config_to_dict, load_config
    from jaxtron.errors import ConfigError
    from jaxtron.pipeline.schedules import build_table

    config = load_config("configs/tiny.yaml", ["mesh.stage=2", "mesh.data=4",
                                               "pipeline.microbatches=2", "train.batch_size=8",
                                               "data.seq_len=32", "model.num_layers=4"])
    measured = {}
    rows = bench.compare_schedules(config, ["1f1b", "interleaved", "zb-h1:stored"], 0, 1, 1,
                                   measured)["schedules"]
    # A row that is the run's own config is the run's measurement, not a second compile.
    assert len(measured) == 3
    own = config_from_dict(config_to_dict(config), ["pipeline.schedule=1f1b"])
    assert bench.measured_once(own, jax.devices(), 0, 1, 1, measured)["step_s"] == rows[
        "1f1b"]["step_s"] and len(measured) == 3
    for row in rows.values():  # each against the first schedule's time, measured in the run
        assert row["step_time_ratio"] == pytest.approx(row["step_s"] / rows["1f1b"]["step_s"])
        assert row["parallel_ratio"] == pytest.approx(row["parallel_units"]
                                                      / rows["1f1b"]["parallel_units"])
    assert rows["interleaved"]["virtual_stages"] == 2
    assert rows["1f1b"]["recompute"] and not rows["zb-h1:stored"]["recompute"]
    # jobs at their lengths: 1F1B's backwards (3 forwards' work) stall their neighbours
    assert rows["zb-h1:stored"]["parallel_ratio"] < 1.0 == rows["1f1b"]["parallel_ratio"]
    interleaved = build_table("interleaved", 2, 2, 2, recompute=True)
    assert rows["interleaved"]["bubble"] == interleaved.bubble < rows["1f1b"]["bubble"] == 1 / 3
    with pytest.raises(ConfigError, match="mesh.stage > 1"):
        bench.compare_schedules(load_config("configs/tiny.yaml", ["mesh.data=8"]), ["1f1b"],
                                0, 1, 1)


def test_grouped_matmul_speed_compares_the_same_work(capsys):
    """The grouped matmul and its dense yardstick compute the same product when the groups are
    equal; the report's rates follow from the FLOPs and the times it prints."""
    import json

    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxtron.kernels import grouped_speed
    from jaxtron.kernels.fp8 import grouped_matmul

    sizes = grouped_speed.group_sizes(1000, 4)
    assert sizes.sum() == 1000 and list(sizes) == sorted(sizes, reverse=True)
    assert sizes[0] > sizes[-1]
    x = jax.random.normal(jax.random.key(0), (1, 64, 8))
    w = jax.random.normal(jax.random.key(1), (4, 8, 5))
    np.testing.assert_allclose(
        grouped_matmul(x, w, jnp.full((1, 4), 16)).reshape(4, 16, 5),
        jnp.einsum("egd,edf->egf", x.reshape(4, 16, 8), w), rtol=1e-5, atol=1e-5)
    assert grouped_speed.main(["--rows", "256", "--d-model", "32", "--ffn", "16", "--experts",
                               "4", "--dtype", "fp32", "--iters", "2", "--repeats", "1",
                               "--json"]) == 0
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert r["flops"] == 2 * 256 * 32 * 16
    assert r["grouped_tflops"] == pytest.approx(r["flops"] / r["grouped_ms"] / 1e9)
    assert r["grouped_over_dense_time"] == pytest.approx(r["grouped_ms"] / r["dense_ms"])
