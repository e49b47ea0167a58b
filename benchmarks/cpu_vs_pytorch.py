"""Single-device CPU training throughput: jaxtron against PyTorch on the same GPT, side by side.

    python benchmarks/cpu_vs_pytorch.py            # needs `pip install torch` (any build)

The model is GPT-2 style (learned positions, LayerNorm, GELU, biases, tied embeddings), 6
layers, width 384, 6 heads, sequence 256, batch 8, fp32, AdamW with clipping: one full
training step each. PyTorch uses `scaled_dot_product_attention`; jaxtron is the step
`jaxtron.train` runs, on one device, as configured, with `model.remat=save_dots` (on a CPU,
recomputing a block's elementwise work is cheaper than storing it) and with the opt-in
`JAXTRON_CPU_MATMULS=onednn` (oneDNN's matmuls instead of XLA's default). Like `jaxtron.train`,
it first tunes glibc malloc for XLA:CPU (`jaxtron.runtime.host_memory`). They alternate for
`--rounds` rounds and ratios of the medians are printed, so machine noise hits all alike.
Each line also shows the cores kept busy (process CPU time over wall time; PyTorch's OpenMP
threads spin while they wait, so its figure is an upper bound on useful work).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

LAYERS, WIDTH, HEADS, SEQ, BATCH, VOCAB = 6, 384, 6, 256, 8, 256


def torch_step():
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
            self.qkv, self.proj = nn.Linear(WIDTH, 3 * WIDTH), nn.Linear(WIDTH, WIDTH)
            self.up, self.down = nn.Linear(WIDTH, 4 * WIDTH), nn.Linear(4 * WIDTH, WIDTH)

        def forward(self, x):
            b, n, _ = x.shape
            q, k, v = self.qkv(self.ln1(x)).split(WIDTH, dim=2)
            q, k, v = (t.view(b, n, HEADS, -1).transpose(1, 2) for t in (q, k, v))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.proj(y.transpose(1, 2).reshape(b, n, WIDTH))
            return x + self.down(F.gelu(self.up(self.ln2(x)), approximate="tanh"))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok, self.pos = nn.Embedding(VOCAB, WIDTH), nn.Embedding(SEQ, WIDTH)
            self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
            self.ln = nn.LayerNorm(WIDTH)

        def forward(self, idx):
            x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
            for block in self.blocks:
                x = block(x)
            return self.ln(x) @ self.tok.weight.T

    torch.manual_seed(0)
    model = GPT()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1))

    def step():
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return loss.item()

    return step


def jaxtron_step(*overrides: str, matmuls: str = "xla"):
    import jax

    from jaxtron import bench
    from jaxtron.config.loading import load_config

    config = load_config("configs/tiny.yaml", [
        "model.type=gpt2", f"model.num_layers={LAYERS}", f"model.d_model={WIDTH}",
        f"model.num_heads={HEADS}", "model.num_kv_heads=null", f"model.mlp_dim={4 * WIDTH}",
        f"model.vocab_size={VOCAB}", f"data.seq_len={SEQ}", f"train.batch_size={BATCH}",
        "mesh.data=1", *overrides])
    from jaxtron.runtime.cpu_matmuls import ENV
    from jaxtron.training.trainer import Trainer

    os.environ[ENV] = matmuls  # read when the Trainer builds its steps
    trainer = Trainer(config, jax.devices()[:1])
    state = {"state": trainer.init_state()}
    batch = trainer.put_batch({"tokens": bench.random_tokens(config)})
    compiled = trainer.compile_step(state["state"], batch)

    def step():
        state["state"], metrics = compiled(state["state"], batch)
        return float(metrics["loss"])

    return step


def timed(step, steps: int) -> tuple[float, float]:
    """-> (seconds per step, cores kept busy: process CPU time over wall time)."""
    start, cpu_start = time.perf_counter(), time.process_time()
    for _ in range(steps):
        step()
    wall = time.perf_counter() - start
    return wall / steps, (time.process_time() - cpu_start) / wall


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    from jaxtron.runtime.host_memory import keep_freed_host_memory

    keep_freed_host_memory()  # as jaxtron.train does, before JAX starts its threads
    try:
        steps = {"jaxtron": jaxtron_step(),
                 "jaxtron, remat=save_dots": jaxtron_step("model.remat=save_dots"),
                 "jaxtron, oneDNN matmuls": jaxtron_step(matmuls="onednn"),
                 "pytorch": torch_step()}
    except ImportError as err:
        print(f"skipped: {err}; pip install torch to compare")
        return 0
    for step in steps.values():
        step()  # warm up (compile, allocator)
    times = {name: [] for name in steps}
    busy = {name: [] for name in steps}
    for _ in range(args.rounds):
        for name, step in steps.items():
            seconds, cores = timed(step, args.steps)
            times[name].append(seconds)
            busy[name].append(cores)
    medians = {name: statistics.median(values) for name, values in times.items()}
    for name, median in medians.items():
        print(f"{name:26} {BATCH * SEQ / median:8,.0f} tok/s (median step {1e3 * median:.0f} ms, "
              f"{statistics.median(busy[name]):.2f} cores busy)"
              + ("" if name == "pytorch" else
                 f"  {medians['pytorch'] / median:.2f} x pytorch's throughput"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
