"""Cross-field checks of a loaded config: each names the fields involved and the fix.

`loading.config_from_dict` runs `validate` on every config it builds; `config_warnings` lists
settings that run but probably not as meant (the CLI prints them before training);
`check_layout` checks what a mesh of given degrees needs of the batch and the model's widths
(the trainer runs it on its mesh, the planner on every candidate layout).
"""

from __future__ import annotations

import math

from jaxtron.config.schema import Config, DataConfig, ModelConfig
from jaxtron.errors import ConfigError


def config_warnings(c: Config) -> list[str]:
    """Settings that run but probably not as meant; the CLI prints each before training."""
    found = []
    window = c.model.sliding_window
    if window is not None and window >= c.model.max_seq_len:
        found.append(f"model.sliding_window={window} is at least model.max_seq_len="
                     f"{c.model.max_seq_len}: no sequence this model reads or generates is longer, "
                     "so the window never applies; lower it, or set it to null for full causal "
                     "attention.")
    if c.optim.warmup_steps > c.train.steps:
        found.append(f"optim.warmup_steps={c.optim.warmup_steps} exceeds train.steps="
                     f"{c.train.steps}: the learning rate rises for the whole run and ends at "
                     f"{c.train.steps / c.optim.warmup_steps:.0%} of optim.lr; lower "
                     "optim.warmup_steps to reach the peak.")
    return found


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def _check_blend(d: DataConfig) -> None:
    if d.blend is None:
        return
    _check(len(d.blend) > 0, "data.blend is an empty list; give at least one {path, weight} "
           "or remove it to train on data.path.")
    labels = [s.label for s in d.blend]
    for i, source in enumerate(d.blend):
        _check(source.path != "", f"data.blend[{i}].path is missing; give each weight its dataset "
                                    "prefix, as in '0.3 data/a 0.7 data/b'.")
        _check(math.isfinite(source.weight) and source.weight > 0,
               f"data.blend[{i}].weight={source.weight} (source {source.path}) must be positive "
               "and finite; give it a share above 0 or remove the source.")
        _check(labels.count(source.label) == 1,
               f"data.blend[{i}] ({source.path}) has the label {source.label!r} of another "
               "source; give each a distinct data.blend[i].name.")


def validate(c: Config) -> None:
    """ConfigError, naming the fields and the fix, for the first impossible setting found."""
    _validate_sizes(c)
    _validate_ranges(c)
    _validate_model(c.model, c.data)
    _check_blend(c.data)
    _validate_data_and_train(c)
    _validate_optim(c.optim)
    _validate_checkpoint(c)
    _validate_mesh(c)
    _validate_mla(c.model)
    _validate_moe(c)
    _validate_pipeline(c)
    _validate_distributed(c)


def _validate_sizes(c: Config) -> None:
    m, t, o, d = c.model, c.train, c.optim, c.data
    positive = {"model.num_layers": m.num_layers, "model.d_model": m.d_model,
                "model.num_heads": m.num_heads, "model.mlp_dim": m.mlp_dim,
                "model.vocab_size": m.vocab_size, "model.max_seq_len": m.max_seq_len,
                "model.loss_chunk_tokens": m.loss_chunk_tokens,
                "train.steps": t.steps, "train.batch_size": t.batch_size,
                "train.log_every": t.log_every, "train.eval_batches": t.eval_batches,
                "optim.grad_accum": o.grad_accum, "data.seq_len": d.seq_len,
                "pipeline.microbatches": c.pipeline.microbatches,
                "pipeline.virtual_stages": c.pipeline.virtual_stages,
                "model.fp8_amax_history": m.fp8_amax_history}
    for name, value in positive.items():
        _check(value > 0, f"{name}={value} must be a positive integer.")


# Numbers with a range of their own: (dotted field, lowest, whether the lowest is allowed, the
# highest allowed or None, what the field is, for the message).
RANGES = (
    ("model.rope_theta", 0.0, False, None, "RoPE's base frequency (Llama 3: 500000)"),
    ("model.norm_eps", 0.0, False, None, "the norms' epsilon (1e-5 or 1e-6)"),
    ("model.init_std", 0.0, False, None, "the initialiser's standard deviation (0.02)"),
    ("model.mtp_loss_coef", 0.0, True, None, "the weight of the MTP loss (0.3)"),
    ("moe.num_experts", 0, True, None, "experts per MoE layer (0 = a dense model)"),
    ("moe.shared_experts", 0, True, None, "always-on shared experts (0 = none)"),
    ("moe.first_dense_layers", 0, True, None, "dense blocks before the MoE ones"),
    ("moe.aux_loss_coef", 0.0, True, None, "the load-balancing loss's weight"),
    ("moe.z_loss_coef", 0.0, True, None, "the router z-loss's weight"),
    ("optim.muon_ns_steps", 1, True, None, "Newton-Schulz iterations (5)"),
    ("optim.muon_momentum", 0.0, True, 1.0, "Muon's momentum, below 1 (0.95)"),
    ("data.builtin_max_bytes", 1, True, None, "bytes of the built-in corpus (4000000)"),
)


def _validate_ranges(c: Config) -> None:
    for name, low, low_ok, high, what in RANGES:
        section, field = name.split(".")
        value = getattr(getattr(c, section), field)
        below = value < low if low_ok else value <= low
        above = high is not None and value >= high
        bound = f">= {low}" if low_ok else f"> {low}"
        _check(not (below or above),
               f"{name}={value} must be {bound}" + (f" and < {high}" if high is not None else "")
               + f": it is {what}; set a value in that range.")
    expert_width = c.moe.expert_mlp_dim
    _check(expert_width is None or expert_width > 0,
           f"moe.expert_mlp_dim={expert_width} must be a positive width, or null for "
           "model.mlp_dim.")


def _validate_model(m: ModelConfig, d: DataConfig) -> None:
    _check(m.sliding_window is None or m.sliding_window > 0,
           f"model.sliding_window={m.sliding_window} must be a positive number of keys (each "
           "query's window, itself included; Mistral 7B v0.1: 4096) or null for full causal "
           "attention.")
    _check(m.num_kv_heads is None or m.num_kv_heads > 0,
           f"model.num_kv_heads={m.num_kv_heads} must be positive or null (= num_heads).")
    _check(m.head_dim is not None or m.d_model % m.num_heads == 0,
           f"model.d_model={m.d_model} is not divisible by model.num_heads={m.num_heads}; "
           "change one of them or set model.head_dim explicitly.")
    _check(m.num_heads % m.kv_heads == 0,
           f"model.num_heads={m.num_heads} must be a multiple of model.num_kv_heads="
           f"{m.kv_heads} (each kv head serves a whole group of query heads).")
    _check(m.type != "gpt2" or m.kv_heads == m.num_heads,
           f"model.type=gpt2 uses multi-head attention; set model.num_kv_heads=null "
           f"(got {m.num_kv_heads}).")
    _check(m.type != "llama" or m.resolved_head_dim % 2 == 0,
           f"RoPE needs an even head dimension; model.head_dim resolves to {m.resolved_head_dim}: "
           "set model.head_dim (or d_model / num_heads) to an even number.")
    _check(not m.qkv_bias or (m.type == "llama" and m.attention != "mla"),
           "model.qkv_bias=true needs model.type=llama with model.attention other than mla "
           "(gpt2 already biases every projection; latent attention has none).")
    _check(not m.qk_norm or (m.type == "llama" and m.attention == "mha"),
           f"model.qk_norm=true needs model.type=llama and model.attention=mha (got "
           f"{m.type}, {m.attention}); set model.qk_norm=false.")
    _validate_rope(m)
    if m.mtp_depth:
        _check(m.mtp_depth > 0 and m.mtp_depth < d.seq_len,
               f"model.mtp_depth={m.mtp_depth} must be 0 (off) or between 1 and "
               f"data.seq_len - 1.")
        _check(m.type == "llama", "model.mtp_depth needs model.type=llama (its modules embed "
               "future tokens without learned positions).")


def _validate_rope(m: ModelConfig) -> None:
    if m.rope_scaling == "none":
        return
    _check(m.type == "llama", f"model.rope_scaling={m.rope_scaling} needs model.type=llama "
           "(gpt2 has learned positions, no RoPE).")
    _check(m.rope_factor > 0 and m.rope_original_max_len > 0,
           f"model.rope_factor={m.rope_factor} and model.rope_original_max_len="
           f"{m.rope_original_max_len} must be positive.")
    _check(m.rope_scaling != "llama3" or m.rope_high_freq_factor > m.rope_low_freq_factor,
           f"model.rope_high_freq_factor={m.rope_high_freq_factor} must exceed "
           f"model.rope_low_freq_factor={m.rope_low_freq_factor} (Llama 3.1: 4 and 1).")
    _check(m.rope_scaling != "yarn" or m.rope_beta_fast > m.rope_beta_slow,
           f"model.rope_beta_fast={m.rope_beta_fast} must exceed model.rope_beta_slow="
           f"{m.rope_beta_slow} (YaRN: 32 and 1).")


def _validate_data_and_train(c: Config) -> None:
    m, t, d = c.model, c.train, c.data
    _check(d.workers >= 0 and d.prefetch >= 0,
           f"data.workers={d.workers} and data.prefetch={d.prefetch} must be 0 or more.")
    _check(d.seq_len <= m.max_seq_len,
           f"data.seq_len={d.seq_len} exceeds model.max_seq_len={m.max_seq_len}; raise "
           "model.max_seq_len or shorten data.seq_len.")
    _check(t.batch_size % c.optim.grad_accum == 0,
           f"train.batch_size={t.batch_size} must be divisible by optim.grad_accum="
           f"{c.optim.grad_accum}.")
    _check(t.eval_every >= 0, f"train.eval_every={t.eval_every} must be >= 0.")
    _check(0.0 < d.val_fraction < 1.0,
           f"data.val_fraction={d.val_fraction} must lie strictly between 0 and 1.")
    _check(t.profile_steps is None or (len(t.profile_steps) == 2
                                       and 1 <= t.profile_steps[0] <= t.profile_steps[1]),
           f"train.profile_steps={list(t.profile_steps or [])} must be [first, last] with "
           "1 <= first <= last, e.g. [10, 12].")


def _validate_optim(o) -> None:
    _check(0.0 <= o.min_lr_ratio <= 1.0,
           f"optim.min_lr_ratio={o.min_lr_ratio} must lie in [0, 1].")
    _check(o.warmup_steps >= 0, f"optim.warmup_steps={o.warmup_steps} must be >= 0.")
    _check(o.decay_steps is None or o.decay_steps > o.warmup_steps,
           f"optim.decay_steps={o.decay_steps} must exceed optim.warmup_steps="
           f"{o.warmup_steps} (the decay starts after warmup), or be null (= train.steps).")
    _check(0.0 < o.decay_fraction <= 1.0,
           f"optim.decay_fraction={o.decay_fraction} must lie in (0, 1].")
    _check(o.lr > 0, f"optim.lr={o.lr} must be positive.")
    for name in ("b1", "b2"):
        _check(0.0 <= getattr(o, name) < 1.0,
               f"optim.{name}={getattr(o, name)} must lie in [0, 1) (Adam's decay rates, e.g. "
               "0.9 and 0.95).")
    _check(o.eps > 0, f"optim.eps={o.eps} must be positive.")
    _check(o.weight_decay >= 0, f"optim.weight_decay={o.weight_decay} must be >= 0.")
    _check(o.grad_clip >= 0, f"optim.grad_clip={o.grad_clip} must be >= 0 (0 = off).")


def _validate_checkpoint(c: Config) -> None:
    every = c.checkpoint.every
    _check(every == "auto" if isinstance(every, str) else every >= 0,
           f"checkpoint.every={every!r} must be a number of steps >= 0 or auto.")
    _check(c.checkpoint.mtbf_hours > 0,
           f"checkpoint.mtbf_hours={c.checkpoint.mtbf_hours} must be > 0 (the expected hours "
           "between failures of the job).")
    _check(c.checkpoint.keep >= 1, f"checkpoint.keep={c.checkpoint.keep} must be >= 1.")


MESH_DEGREES = ("data", "fsdp", "tensor", "sequence", "expert", "stage")


def _validate_mesh(c: Config) -> None:
    mesh = c.mesh
    for name in MESH_DEGREES:
        value = getattr(mesh, name)
        _check(value == -1 or value > 0,
               f"mesh.{name}={value} must be a positive degree or -1 (= the devices left over).")
    _check(sum(getattr(mesh, n) == -1 for n in MESH_DEGREES) <= 1,
           "only one of mesh.data, mesh.fsdp, mesh.tensor, mesh.sequence, mesh.expert, "
           "mesh.stage may be -1 (= the rest); give the others explicit values.")
    for name in ("data", "fsdp", "stage"):
        dcn, total = getattr(mesh, f"dcn_{name}"), getattr(mesh, name)
        _check(dcn > 0, f"mesh.dcn_{name}={dcn} must be a positive integer.")
        _check(total == -1 or total % dcn == 0,
               f"mesh.dcn_{name}={dcn} must divide mesh.{name}={total}: it is the cross-host "
               f"factor of that degree.")
    if mesh.sequence > 0 and mesh.tensor > 0 and c.model.num_heads % mesh.tensor == 0:
        _check_context_parallel(c, mesh.sequence, mesh.tensor)  # again on the built mesh


def _validate_distributed(c: Config) -> None:
    dist = c.distributed
    _check(dist.num_processes is None or dist.num_processes >= 1,
           f"distributed.num_processes={dist.num_processes} must be >= 1 or null (= detect).")
    _check(dist.process_id is None or dist.process_id >= 0,
           f"distributed.process_id={dist.process_id} must be >= 0 or null (= detect).")
    for name in ("init_timeout_s", "heartbeat_timeout_s"):
        _check(getattr(dist, name) > 0,
               f"distributed.{name}={getattr(dist, name)} must be positive.")


def _validate_mla(m: ModelConfig) -> None:
    if m.attention != "mla":
        return
    _check(m.type == "llama", f"model.attention=mla needs model.type=llama (RoPE, RMSNorm); "
           f"got model.type={m.type}.")
    _check(m.num_kv_heads in (None, m.num_heads),
           f"model.num_kv_heads={m.num_kv_heads} does not apply to model.attention=mla (every "
           "head decompresses its own keys and values from the latent); set it to null.")
    for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
        _check(getattr(m, name) > 0, f"model.{name}={getattr(m, name)} must be a positive "
               "integer with model.attention=mla.")
    _check(m.q_lora_rank is None or m.q_lora_rank >= 0,
           f"model.q_lora_rank={m.q_lora_rank} must be positive, or 0 / null for a plain "
           "query projection.")
    _check(m.qk_rope_head_dim % 2 == 0, f"model.qk_rope_head_dim={m.qk_rope_head_dim} must be "
           "even: RoPE rotates pairs of dimensions.")


def _validate_moe(c: Config) -> None:
    moe, expert = c.moe, c.mesh.expert
    if not moe.enabled:
        _check(expert == 1, f"mesh.expert={expert} needs a mixture-of-experts model; set "
               "moe.num_experts (for example 8) or mesh.expert=1.")
        return
    _check(moe.num_experts >= 0, f"moe.num_experts={moe.num_experts} must be >= 0.")
    _check(1 <= moe.top_k <= moe.num_experts, f"moe.top_k={moe.top_k} must lie between 1 and "
           f"moe.num_experts={moe.num_experts}.")
    dense = moe.first_dense_layers
    _check(0 <= dense < c.model.num_layers,
           f"moe.first_dense_layers={dense} must lie between 0 and model.num_layers - 1 = "
           f"{c.model.num_layers - 1} (at least one MoE layer).")
    _check(moe.every >= 1 and (c.model.num_layers - dense) % moe.every == 0,
           f"moe.every={moe.every} must divide "
           + (f"the {c.model.num_layers - dense} layers after moe.first_dense_layers={dense}"
              if dense else f"model.num_layers={c.model.num_layers}")
           + " (each group of moe.every blocks ends with one MoE block).")
    _check(moe.capacity_factor > 0, f"moe.capacity_factor={moe.capacity_factor} must be > 0.")
    factor = moe.ep_buffer_factor
    _check(factor is None or (math.isfinite(factor) and factor > 0),
           f"moe.ep_buffer_factor={factor} must be > 0 (e.g. 1.5), or null for room for every "
           "assignment.")
    _check(factor is None or moe.mode == "dropless",
           f"moe.ep_buffer_factor={factor} sizes dropless dispatch; set moe.mode=dropless, or "
           "use moe.capacity_factor with moe.mode=capacity.")
    _check(expert == -1 or moe.num_experts % expert == 0,
           f"moe.num_experts={moe.num_experts} must be divisible by mesh.expert={expert} so "
           "every expert-parallel rank holds whole experts.")
    _check(moe.score == "softmax" or moe.router == "topk_then_softmax",
           f"moe.router={moe.router} has no meaning with moe.score={moe.score} (the weights are "
           "the chosen scores normalised to sum 1); use moe.router=topk_then_softmax.")
    _check(moe.route_scale > 0, f"moe.route_scale={moe.route_scale} must be > 0.")
    _check(moe.bias_update_rate >= 0,
           f"moe.bias_update_rate={moe.bias_update_rate} must be 0 (off) or positive.")
    groups, top_groups = moe.route_groups, moe.route_top_groups
    _check(groups >= 1 and moe.num_experts % groups == 0,
           f"moe.route_groups={groups} must divide moe.num_experts={moe.num_experts} into equal "
           "groups; pick a divisor (1 = no group-limited routing).")
    _check(1 <= top_groups <= groups, f"moe.route_top_groups={top_groups} must lie between 1 and "
           f"moe.route_groups={groups}.")
    reachable = top_groups * (moe.num_experts // groups)
    _check(moe.top_k <= reachable, f"moe.top_k={moe.top_k} exceeds the {reachable} experts of "
           f"moe.route_top_groups={top_groups} groups; raise moe.route_top_groups or lower "
           "moe.top_k.")


def _validate_pipeline(c: Config) -> None:
    pp, stages = c.pipeline, c.mesh.stage
    _check(stages == 1 or c.model.fp8 != "delayed",
           "model.fp8=delayed is not supported on a pipeline (mesh.stage > 1): the stages "
           "would sum their amax observations; use model.fp8=tensorwise.")
    if stages == 1:
        _check(pp.microbatches == 1 and pp.virtual_stages == 1 and pp.layers_per_stage is None,
               "pipeline.microbatches, pipeline.virtual_stages and pipeline.layers_per_stage "
               "need mesh.stage > 1; without a pipeline use optim.grad_accum for microbatches.")
        return
    _check(stages > 1, f"mesh.stage={stages} must be an explicit degree (-1 is not allowed for "
           "the pipeline axis).")
    v, m = pp.virtual_stages, pp.microbatches
    if pp.schedule == "interleaved":
        _check(v >= 2, f"pipeline.schedule=interleaved needs pipeline.virtual_stages >= 2 "
               f"(got {v}); use 1f1b for one chunk per device.")
        _check(m % stages == 0, f"pipeline.schedule=interleaved needs pipeline.microbatches "
               f"({m}) to be a multiple of mesh.stage ({stages}).")
    elif pp.schedule == "zbv":
        _check(v == 2, f"pipeline.schedule=zbv runs two chunks per rank: set "
               f"pipeline.virtual_stages=2 (got {v}).")
    elif pp.schedule != "auto":  # auto chooses among the schedules that run v chunks
        _check(v == 1, f"pipeline.virtual_stages={v} needs pipeline.schedule=interleaved.")
    n_virtual = stages * v
    every = c.moe.every if c.moe.enabled else 1  # MoE models split in groups of `every` blocks
    if pp.layers_per_stage is None:
        _check(c.moe.stacked_layers(c.model.num_layers) // every >= n_virtual,
               f"model.num_layers={c.model.num_layers} cannot be split over mesh.stage x "
               f"pipeline.virtual_stages = {n_virtual} pipeline stages"
               + (f" in groups of moe.every={every} blocks" if every > 1 else "")
               + "; use fewer stages.")
    else:
        counts = pp.layers_per_stage
        _check(len(counts) == n_virtual and sum(counts) == c.model.num_layers
               and min(counts) >= 1,
               f"pipeline.layers_per_stage={list(counts)} must list {n_virtual} positive layer "
               f"counts (mesh.stage x pipeline.virtual_stages) summing to model.num_layers="
               f"{c.model.num_layers}.")
        dense = c.moe.dense_prefix
        _check(counts[0] - dense >= every and all(
            count % every == 0 for count in (counts[0] - dense, *counts[1:])),
               f"pipeline.layers_per_stage={list(counts)} must be multiples of moe.every="
               f"{every}"
               + (f" after the moe.first_dense_layers={dense} dense blocks, which run on the "
                  "first stage (its count includes them)" if dense else "")
               + ": a stage holds whole groups of dense blocks and their MoE block.")
    per_step = c.train.batch_size // c.optim.grad_accum
    _check(per_step % m == 0, f"train.batch_size / optim.grad_accum = {per_step} must be "
           f"divisible by pipeline.microbatches={m}.")


def check_layout(c: Config, degrees: dict[str, int]) -> None:
    """Divisibility a mesh of `degrees` needs of the batch, sequence and model widths."""
    split = degrees["data"] * degrees["fsdp"] * degrees["expert"]
    parts = c.optim.grad_accum * (c.pipeline.microbatches if c.mesh.stage > 1 else 1)
    micro = c.train.batch_size // parts
    if micro % split:
        raise ConfigError(
            f"each microbatch of train.batch_size / (optim.grad_accum x "
            f"pipeline.microbatches) = {micro} sequences must split evenly over mesh.data x "
            f"mesh.fsdp x mesh.expert = {split} devices; make train.batch_size a multiple of "
            f"{split * parts}.")
    tensor = degrees["tensor"]
    _check_context_parallel(c, degrees["sequence"], tensor)
    if c.mesh.sequence_parallel and c.data.seq_len % (tensor * degrees["sequence"]):
        raise ConfigError(
            f"data.seq_len={c.data.seq_len} must be divisible by mesh.tensor x mesh.sequence "
            f"= {tensor * degrees['sequence']} for mesh.sequence_parallel=true.")
    for field, size in (("num_heads", c.model.num_heads), ("mlp_dim", c.model.mlp_dim),
                        ("vocab_size", c.model.vocab_size)):
        if size % tensor:
            raise ConfigError(f"mesh.tensor={tensor} must divide model.{field}={size}; "
                              "choose a tensor degree that divides it.")
    if c.model.d_model % degrees["fsdp"]:
        raise ConfigError(f"mesh.fsdp={degrees['fsdp']} must divide "
                          f"model.d_model={c.model.d_model}.")


def _check_context_parallel(c: Config, n: int, tensor: int) -> None:
    """A ring cuts the sequence into 2n chunks (zig-zag); all-to-all cuts it into n and hands
    each device H / (tensor x n) whole query heads and the kv heads they read; hybrid runs
    all-to-all within groups of g and rings of n / g across them."""
    mode, g = c.mesh.context_parallel, c.mesh.all_to_all_group
    _check(mode == "hybrid" or g == 1,
           f"mesh.all_to_all_group={g} is only read with mesh.context_parallel=hybrid; set "
           "mesh.context_parallel=hybrid, or remove it.")
    if mode == "ring":
        _check(c.data.seq_len % (2 * n) == 0,
               f"data.seq_len={c.data.seq_len} must be a multiple of 2 x mesh.sequence = "
               f"{2 * n}: ring context parallelism cuts the sequence into two chunks per device.")
        return
    if mode == "hybrid":
        _check(1 < g < n and n % g == 0,
               f"mesh.context_parallel=hybrid needs mesh.all_to_all_group={g} above 1, below "
               f"mesh.sequence={n} and dividing it (the all-to-all inside each group, rings of "
               "mesh.sequence / group across them); or use ring or all_to_all.")
        rings = n // g
        _check(c.data.seq_len % (2 * rings) == 0 and c.data.seq_len % n == 0,
               f"data.seq_len={c.data.seq_len} must be a multiple of mesh.sequence={n} and of "
               f"2 x the {rings} ring members for mesh.context_parallel=hybrid.")
        n = g  # what the all-to-all splits
    if n == 1:
        return
    _check(c.data.seq_len % n == 0,
           f"data.seq_len={c.data.seq_len} must be a multiple of mesh.sequence={n} for "
           "mesh.context_parallel=all_to_all.")
    heads = c.model.num_heads // tensor
    _check(heads % n == 0,
           f"mesh.context_parallel={mode} hands each of the {n} devices of an all-to-all whole "
           f"query heads, but model.num_heads / mesh.tensor = {heads} does not split {n} ways; "
           "choose mesh.sequence dividing it, or mesh.context_parallel=ring.")
    kv = kv_heads_per_rank(c.model, tensor)
    _check(kv % n == 0 or n % kv == 0,
           f"mesh.context_parallel={mode} needs the {kv} kv head(s) of a tensor rank to split "
           f"over the {n} devices of an all-to-all or to be repeated up to them (one divides the "
           "other); "
           "choose mesh.sequence accordingly, or mesh.context_parallel=ring.")


def kv_heads_per_rank(m: ModelConfig, tensor: int) -> int:
    """The kv heads the query heads of one tensor rank read: its share of them, or, with kv
    heads replicated over tensor (fewer than ranks), those it keeps (`kernels/per_device.py`);
    multi-head latent attention decompresses k and v per query head."""
    heads = m.num_heads // tensor
    if m.attention == "mla":
        return heads
    if m.kv_heads % tensor == 0:
        return m.kv_heads // tensor
    return 1 if (m.num_heads // m.kv_heads) % heads == 0 else heads


def all_to_all_splits(m: ModelConfig, tensor: int, n: int) -> bool:
    """Whether an all-to-all over n devices can hand each whole query heads and the kv heads
    they read (split, or repeated up to n): what `_check_context_parallel` requires."""
    kv = kv_heads_per_rank(m, tensor)
    return (m.num_heads // tensor) % n == 0 and (kv % n == 0 or n % kv == 0)
