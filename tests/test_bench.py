"""The attention benchmark's CPU smoke run: `python -m jaxtron.kernels.bench` end to end."""

import json
import os
import subprocess
import sys

from jaxtron.kernels.bench import MODES, attention_flops


def test_flop_count_follows_the_flashattention_convention():
    full = attention_flops(1, 16, 1024, 128, causal=False, mode="fwd")
    assert full == 4 * 16 * 1024 ** 2 * 128
    assert attention_flops(1, 16, 1024, 128, causal=True, mode="fwd") == full / 2
    assert attention_flops(1, 16, 1024, 128, causal=False, mode="fwd+bwd") == 3.5 * full


def test_cpu_smoke_run_prints_a_table_and_a_json_line():
    # Tiny shapes: Pallas runs in interpret mode on CPU, one grid step at a time. The timeout
    # turns a hang into a failure rather than a stuck suite.
    command = [sys.executable, "-m", "jaxtron.kernels.bench", "--seq-lens", "128,256",
               "--impls", "xla,cudnn,pallas", "--heads", "2", "--kv-heads", "1",
               "--head-dim", "32", "--warmup", "1", "--iters", "1", "--repeats", "1", "--json"]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-2000:]
    lines = result.stdout.strip().splitlines()
    report = json.loads(lines[-1])
    assert "pallas/xla" in result.stdout and "cudnn skipped" in result.stdout
    assert report["impls"] == ["xla", "pallas"]
    cells = {(r["seq_len"], r["mode"], r["impl"]): r for r in report["results"]}
    assert set(cells) == {(n, m, i) for n in (128, 256) for m in MODES for i in ("xla", "pallas")}
    assert all(r["tflops"] > 0 and r["ms"] > 0 for r in cells.values()), cells
