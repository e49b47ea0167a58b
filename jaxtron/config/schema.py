"""The config tree: one frozen dataclass per section, every field declared once.

    python -m jaxtron.train --config configs/tiny.yaml train.steps=50 model.num_layers=4

Each field has its type, default and a one-line meaning (the `help` metadata, which `--help`
prints). `loading.py` builds the tree from YAML and overrides, `checks.py` refuses impossible
combinations. Values that follow from others (head_dim, the resolved number of kv heads) are
properties, never stored twice.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from jaxtron.config.platforms import compute_dtype, local_platform
from jaxtron.errors import ConfigError


def _f(default, help: str, choices: tuple | None = None):
    return field(default=default, metadata={"help": help, "choices": choices})


COMPUTE_DTYPES = ("float32", "bfloat16", "float16")
PACKINGS = ("stream", "documents")
REMAT_POLICIES = ("none", "full", "save_dots", "offload")
ATTENTION_IMPLS = ("auto", "xla", "cudnn", "pallas")
MODEL_TYPES = ("llama", "gpt2")
ATTENTIONS = ("mha", "mla")
PIPELINE_SCHEDULES = ("auto", "1f1b", "gpipe", "interleaved", "zb-h1", "zbv")
CONTEXT_PARALLEL = ("ring", "all_to_all", "hybrid")


@dataclass(frozen=True)
class ModelConfig:
    type: str = _f("llama", "architecture family: llama (RMSNorm, RoPE, SwiGLU, GQA, untied) "
                   "or gpt2 (LayerNorm, learned positions, GELU, tied)", MODEL_TYPES)
    num_layers: int = _f(2, "number of transformer blocks")
    d_model: int = _f(128, "residual stream width")
    num_heads: int = _f(4, "query heads")
    num_kv_heads: int | None = _f(None, "key/value heads for grouped-query attention (null = num_heads)")
    head_dim: int | None = _f(None, "per-head width (null = d_model / num_heads)")
    mlp_dim: int = _f(512, "hidden width of the feed-forward block")
    vocab_size: int = _f(256, "embedding rows; must cover the data's tokenizer")
    max_seq_len: int = _f(2048, "longest sequence the position encoding supports")
    fp8: str = _f("none", "matmuls of the projections, MLPs and experts in "
                  "fp8: e4m3 forward, e5m2 gradients, per-tensor scales, current (tensorwise) "
                  "or from an amax history (delayed; experts keep current scales) "
                  "(jaxtron/kernels/fp8.py); embedding, head and attention stay",
                  ("none", "tensorwise", "delayed"))
    fp8_amax_history: int = _f(1024, "steps of amaxes a delayed fp8 scale looks back over "
                               "(Transformer Engine's amax_history_len)")
    qkv_bias: bool = _f(False, "biases on the query, key and value projections of a llama "
                        "(Qwen2)")
    tie_embeddings: bool | None = _f(None, "output head = the embedding table transposed "
                                     "(null = per type: gpt2 tied, llama untied; Llama 3.2 "
                                     "1B/3B and small Qwen3 models tie)")
    rope_theta: float = _f(10000.0, "RoPE base frequency (llama)")
    rope_scaling: str = _f("none", "RoPE scaling for a longer context: linear (position "
                           "interpolation), llama3 (Llama 3.1), yarn (DeepSeek-V3, Qwen); "
                           "jaxtron/models/rope.py", ("none", "linear", "llama3", "yarn"))
    rope_factor: float = _f(1.0, "rope_scaling: context extension factor")
    rope_original_max_len: int = _f(8192, "llama3 / yarn: context the unscaled RoPE was "
                                    "trained for")
    rope_low_freq_factor: float = _f(1.0, "llama3: wavelengths above original / this are "
                                     "fully scaled")
    rope_high_freq_factor: float = _f(4.0, "llama3: wavelengths below original / this are kept")
    rope_beta_fast: float = _f(32.0, "yarn: pairs turning more often than this over the "
                               "original context are kept")
    rope_beta_slow: float = _f(1.0, "yarn: pairs turning less often than this are fully "
                               "interpolated")
    rope_mscale: float = _f(1.0, "yarn: mscale of the attention factor")
    rope_mscale_all_dim: float = _f(0.0, "yarn: mscale_all_dim (DeepSeek-V3: 1.0; 0 = unused)")
    mtp_depth: int = _f(0, "multi-token prediction modules (DeepSeek-V3: 1), each predicting "
                        "one token further ahead; 0 = off")
    mtp_loss_coef: float = _f(0.3, "weight of the mean multi-token-prediction loss in the "
                              "objective (DeepSeek-V3: 0.3, later 0.1)")
    norm_eps: float = _f(1e-5, "epsilon of RMSNorm / LayerNorm")
    init_std: float = _f(0.02, "standard deviation of the normal weight initialiser")
    dtype: str = _f("auto", "compute dtype of activations and matmuls (auto = bfloat16 on "
                    "GPUs and TPUs, float32 on CPU)", ("auto", *COMPUTE_DTYPES))
    param_dtype: str = _f("float32", "storage dtype of parameters (master weights)", COMPUTE_DTYPES)
    remat: str = _f("none", "activation recompute policy for each block (offload: full, "
                    "with each block's input and attention's output kept in pinned host "
                    "memory)", REMAT_POLICIES)
    scan_layers: bool = _f(True, "run blocks with lax.scan (compile time flat in depth)")
    cross_entropy: str = _f("plain", "loss: plain (full logits) or chunked (fused, logits "
                            "never materialised in full)", ("plain", "chunked"))
    loss_chunk_tokens: int = _f(2048, "tokens per chunk of the chunked cross-entropy")
    attention_impl: str = _f("auto", "attention kernel: auto, xla (reference), cudnn or pallas", ATTENTION_IMPLS)
    sliding_window: int | None = _f(None, "sliding-window attention: each query sees the last "
                                    "w keys up to its own position, itself included (Mistral's "
                                    "sliding_window, 4096 in Mistral 7B v0.1; null = full causal "
                                    "attention)")
    attention: str = _f("mha", "mha: multi-head / grouped-query attention; mla: DeepSeek-V2/V3 "
                        "multi-head latent attention (keys and values from a cached latent)",
                        ATTENTIONS)
    q_lora_rank: int | None = _f(None, "mla: width of the compressed query (null or 0 = a plain "
                                 "query projection)")
    kv_lora_rank: int = _f(64, "mla: width of the key/value latent that decoding caches")
    qk_nope_head_dim: int = _f(32, "mla: per-head query/key width without rotary positions")
    qk_rope_head_dim: int = _f(16, "mla: per-head query/key width with RoPE (the key part is "
                               "shared by all heads)")
    v_head_dim: int = _f(32, "mla: per-head value width")
    qk_norm: bool = _f(False, "RMSNorm of each head's query and key over head_dim before RoPE "
                       "(Qwen3; model.attention=mha)")

    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_heads

    @property
    def compute_dtype(self) -> str:
        """`dtype` with `auto` resolved. A Trainer resolves it for its mesh's platform
        (`platforms.for_platform`); a model built directly resolves it for this process's
        default devices."""
        return self.dtype if self.dtype != "auto" else compute_dtype("auto", local_platform())

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim or self.d_model // self.num_heads

    @property
    def qk_head_dim(self) -> int:
        """Per-head width of queries and keys (mla: the no-position part plus the rotary one)."""
        if self.attention == "mla":
            return self.qk_nope_head_dim + self.qk_rope_head_dim
        return self.resolved_head_dim

    @property
    def value_head_dim(self) -> int:
        return self.v_head_dim if self.attention == "mla" else self.resolved_head_dim

    @property
    def tied_embeddings(self) -> bool:
        return self.type == "gpt2" if self.tie_embeddings is None else self.tie_embeddings


@dataclass(frozen=True)
class MoEConfig:
    num_experts: int = _f(0, "experts per MoE layer (0 = dense model)")
    top_k: int = _f(2, "experts each token is routed to")
    expert_mlp_dim: int | None = _f(None, "hidden width of each expert (null = model.mlp_dim)")
    every: int = _f(1, "an MoE layer every k-th block (k-1 dense blocks, then one MoE block)")
    first_dense_layers: int = _f(0, "dense blocks (width model.mlp_dim) before the MoE ones, "
                                 "which then follow moe.every (DeepSeek-V3: 3)")
    shared_experts: int = _f(0, "always-on shared experts (DeepSeek style), each expert_mlp_dim "
                             "wide")
    router: str = _f("topk_then_softmax", "softmax over the chosen k logits (Mixtral) or "
                     "softmax over all experts then top-k (Switch, GShard)",
                     ("topk_then_softmax", "softmax_then_topk"))
    mode: str = _f("capacity", "capacity: fixed slots per expert, overflow dropped to the "
                   "residual; dropless: grouped matmul over every assignment",
                   ("capacity", "dropless"))
    capacity_factor: float = _f(1.25, "slots per expert per sequence = ceil(factor * seq_len * "
                                "top_k / num_experts)")
    ep_buffer_factor: float | None = _f(None, "dropless with mesh.expert > 1: rows each rank "
                                        "receives = factor x its tokens x top_k; assignments "
                                        "past it are dropped and counted (null = room for every "
                                        "assignment that can come: nothing dropped)")
    score: str = _f("softmax", "router score: softmax over all experts, or sigmoid per expert "
                    "with the chosen k scores normalised to sum 1 (DeepSeek-V3; moe.router is "
                    "then unused and must stay topk_then_softmax)", ("softmax", "sigmoid"))
    route_scale: float = _f(1.0, "factor on the combine weights (DeepSeek-V3: 2.5)")
    bias_update_rate: float = _f(0.0, "auxiliary-loss-free balancing: per-expert routing bias "
                                 "moved this much per step by the sign of each expert's load "
                                 "error (DeepSeek-V3: 1e-3; 0 = off)")
    route_groups: int = _f(1, "experts split into this many equal groups for group-limited "
                           "routing (DeepSeek-V3 node-limited; 1 = off)")
    route_top_groups: int = _f(1, "each token chooses its top_k among the experts of its best "
                               "route_top_groups groups (a group scores the sum of its 2 best)")
    aux_loss_coef: float = _f(0.01, "weight of the Switch load-balancing loss")
    z_loss_coef: float = _f(0.001, "weight of the router z-loss")

    @property
    def enabled(self) -> bool:
        return self.num_experts > 0

    @property
    def dense_prefix(self) -> int:
        """Dense blocks in their own stack before the repeated one (an MoE model's only)."""
        return self.first_dense_layers if self.enabled else 0

    def stacked_layers(self, num_layers: int) -> int:
        """Blocks in the repeated stack: all of them, less the dense prefix."""
        return num_layers - self.dense_prefix


@dataclass(frozen=True)
class MeshConfig:
    data: int = _f(-1, "data-parallel degree (-1 = all devices left over)")
    fsdp: int = _f(1, "fully-sharded data-parallel degree (ZeRO-3)")
    tensor: int = _f(1, "tensor-parallel degree (Megatron column/row split)")
    sequence: int = _f(1, "context-parallel degree (mesh.context_parallel says how)")
    context_parallel: str = _f("ring", "how attention meets a sequence split over "
                               "mesh.sequence: ring (k/v blocks passed round, zig-zag "
                               "balanced), all_to_all (DeepSpeed-Ulysses: the sequence split "
                               "swapped for a head split around the attention kernel) or "
                               "hybrid (all-to-all within groups of mesh.all_to_all_group, "
                               "rings across them)", CONTEXT_PARALLEL)
    all_to_all_group: int = _f(1, "with mesh.context_parallel=hybrid: consecutive devices of "
                               "mesh.sequence that exchange heads by all-to-all (keep them on "
                               "one node); the rings run across the groups")
    expert: int = _f(1, "expert-parallel degree")
    stage: int = _f(1, "pipeline-parallel degree")
    sequence_parallel: bool = _f(False, "Megatron sequence parallelism on the tensor axis")
    dcn_data: int = _f(1, "part of mesh.data that spans hosts (the rest stays inside a host)")
    dcn_fsdp: int = _f(1, "part of mesh.fsdp that spans hosts")
    dcn_stage: int = _f(1, "part of mesh.stage that spans hosts")


@dataclass(frozen=True)
class PipelineConfig:
    schedule: str = _f("auto", "pipeline schedule (with mesh.stage > 1); auto: the fastest "
                       "that fits the device's memory, as the planner predicts them",
                       PIPELINE_SCHEDULES)
    microbatches: int = _f(1, "microbatches per step flowing through the pipeline")
    virtual_stages: int = _f(1, "model chunks per device (interleaved schedule; zbv always "
                             "runs 2, and 1 there means 2)")
    layers_per_stage: tuple[int, ...] | None = _f(
        None, "layers of each virtual stage in order, e.g. [3, 3, 2, 2] (null = as even as "
        "possible)")
    recompute: bool = _f(True, "a pipeline's backward runs its stage again from the stored "
                         "input (true: least memory) or reads the residuals its forward stored "
                         "(false: one forward less per microbatch, Megatron-LM's default)")

    def __post_init__(self):
        if self.schedule == "zbv" and self.virtual_stages == 1:  # its V is two chunks a rank
            object.__setattr__(self, "virtual_stages", 2)


@dataclass(frozen=True)
class TrainConfig:
    steps: int = _f(200, "optimizer steps to run")
    batch_size: int = _f(16, "global batch size in sequences")
    log_every: int = _f(10, "steps between metric lines")
    eval_every: int = _f(100, "steps between held-out evaluations (0 = only at the end)")
    eval_batches: int = _f(4, "batches in each evaluation")
    run_dir: str = _f("runs/default", "where metrics.jsonl and config.yaml are written")
    seed: int = _f(0, "seed for parameters and data order")
    tensorboard: bool = _f(False, "also write the metrics as TensorBoard event files to "
                           "<run_dir>/tensorboard")
    resume: str = _f("auto", "a previous run in the run dir: auto continues from its newest "
                     "good checkpoint; never refuses to start; archive moves it to "
                     "<run_dir>/archive/<time>/ and starts afresh; overwrite deletes it",
                     ("auto", "never", "archive", "overwrite"))
    on_nan: str = _f("stop", "a non-finite loss or gradient: stop (the last checkpoint stays "
                     "intact) or skip that update", ("stop", "skip"))
    profile_steps: tuple[int, ...] | None = _f(
        None, "[first, last]: write a JAX profiler trace of these steps to <run_dir>/profile")
    init_from: str | None = _f(None, "parameters-only checkpoint (python -m jaxtron.export or "
                               "jaxtron.convert) to start training from")


@dataclass(frozen=True)
class OptimConfig:
    name: str = _f("adamw", "adamw, or muon: Newton-Schulz orthogonalised momentum for the "
                   "hidden matrices and Adam for the rest (jaxtron/training/muon.py)", ("adamw", "muon"))
    muon_momentum: float = _f(0.95, "muon: Nesterov momentum of the matrix updates")
    muon_ns_steps: int = _f(5, "muon: Newton-Schulz iterations per update")
    lr: float = _f(3e-3, "peak learning rate")
    min_lr_ratio: float = _f(0.1, "final learning rate as a fraction of lr (the floor of every "
                             "schedule but constant)")
    warmup_steps: int = _f(20, "linear warmup steps")
    schedule: str = _f("cosine", "learning-rate shape after warmup (jaxtron/training/lr_schedule.py)",
                       ("cosine", "linear", "constant", "inverse_sqrt", "wsd"))
    decay_steps: int | None = _f(None, "step at which the decay reaches lr x min_lr_ratio "
                                 "(null = train.steps; Megatron --lr-decay-iters)")
    decay_fraction: float = _f(0.2, "wsd: share of decay_steps spent in the final decay "
                               "(Megatron --lr-wsd-decay-iters / --lr-decay-iters)")
    wsd_shape: str = _f("linear", "wsd: shape of the final decay",
                        ("linear", "cosine", "minus_sqrt"))
    weight_decay: float = _f(0.1, "AdamW decoupled weight decay on matrices")
    b1: float = _f(0.9, "Adam beta1")
    b2: float = _f(0.95, "Adam beta2")
    eps: float = _f(1e-8, "Adam epsilon")
    grad_clip: float = _f(1.0, "global-norm clipping threshold (0 = off)")
    grad_accum: int = _f(1, "microbatches accumulated into one optimizer step")
    zero_stage: int = _f(0, "ZeRO over mesh.data: 1 shards optimizer state, 2 also gradients",
                         (0, 1, 2))
    host_moments: bool = _f(False, "keep the optimizer state in pinned host memory between "
                            "steps: it comes to the device for the update and goes back "
                            "(frees its device memory for a host transfer each step)")
    moment_dtype: str = _f("float32", "dtype the Adam moments are stored in between steps "
                           "(bfloat16 halves them, as DeepSeek-V3; updates are computed in "
                           "float32)", ("float32", "bfloat16"))


@dataclass(frozen=True)
class BlendSource:
    path: str = _f("", "token dataset prefix of this source (or builtin:stdlib)")
    weight: float = _f(1.0, "share of training rows drawn from it (weights are normalised)")
    name: str | None = _f(None, "label of its held-out loss, eval_loss/<name> (default: the "
                          "prefix's file name)")

    @property
    def label(self) -> str:
        return self.name or self.path.rstrip("/").rsplit("/", 1)[-1].rsplit(":", 1)[-1]


def parse_megatron_blend(text: str) -> tuple[BlendSource, ...]:
    """Megatron's `--data-path 0.3 A 0.7 B` form (a lone prefix means weight 1)."""
    words = text.split()
    if len(words) == 1:
        return (BlendSource(path=words[0]),)
    if len(words) % 2:
        raise ConfigError(f"data.blend={text!r} must alternate weights and prefixes, as in "
                          "'0.3 data/a 0.7 data/b'; add the missing weight or prefix.")
    sources = []
    for weight, path in zip(words[::2], words[1::2]):
        try:
            sources.append(BlendSource(path=path, weight=float(weight)))
        except ValueError:
            raise ConfigError(f"data.blend={text!r}: {weight!r} (before {path}) is not a "
                              "number; write it as 'WEIGHT PREFIX WEIGHT PREFIX ...'.") from None
    return tuple(sources)


@dataclass(frozen=True)
class DataConfig:
    path: str = _f("builtin:stdlib", "token dataset prefix (from jaxtron.data.prepare) "
                   "or builtin:stdlib; data.blend replaces it")
    blend: tuple[BlendSource, ...] | str | None = _f(
        None, "weighted sources: a list of {path, weight, name} or Megatron's '0.3 A 0.7 B'")
    seq_len: int = _f(128, "tokens per training sequence")
    val_fraction: float = _f(0.02, "fraction of documents held out for evaluation")
    builtin_max_bytes: int = _f(4_000_000, "size cap of the built-in corpus")
    packing: str = _f("stream", "stream: rows cut from the token stream; documents: attention "
                      "and positions restart at every document of a row", PACKINGS)
    eod_mask_loss: bool = _f(False, "drop the prediction across a document boundary "
                             "(Megatron's --eod-mask-loss)")
    workers: int = _f(2, "threads reading batches ahead of the step (0: read in the loop)")
    prefetch: int = _f(4, "batches read ahead of the step")

    def __post_init__(self):
        if isinstance(self.blend, str):
            object.__setattr__(self, "blend", parse_megatron_blend(self.blend))

    @property
    def sources(self) -> tuple[BlendSource, ...]:
        """The blend, or data.path as the only source."""
        return self.blend or (BlendSource(path=self.path),)


@dataclass(frozen=True)
class CheckpointConfig:
    every: int | str = _f(0, "steps between checkpoints (0 = only at the end and on "
                          "preemption; auto = the interval losing least time to saves and "
                          "failures, from the measured save and step times and "
                          "checkpoint.mtbf_hours: jaxtron/checkpoint/cadence.py)")
    keep: int = _f(3, "newest checkpoints kept")
    mtbf_hours: float = _f(24.0, "expected hours between failures of the whole job, for "
                           "checkpoint.every: auto")


@dataclass(frozen=True)
class DistributedConfig:
    coordinator_address: str | None = _f(
        None, "host:port of process 0 for a multi-process run (null = JAX_COORDINATOR_ADDRESS, "
        "else the first node of a SLURM step)")
    num_processes: int | None = _f(None, "processes in the job (null = JAX_NUM_PROCESSES, else "
                                   "SLURM_NTASKS, else 1)")
    process_id: int | None = _f(None, "this process's rank (null = JAX_PROCESS_ID, else "
                                "SLURM_PROCID)")
    local_device_ids: tuple[int, ...] | None = _f(
        None, "accelerators this process drives (null = all on the node when it runs one "
        "process per node, else the one matching SLURM_LOCALID)")
    init_timeout_s: int = _f(300, "seconds to wait for every process to join")
    heartbeat_timeout_s: int = _f(100, "seconds without a heartbeat after which a process is "
                                  "declared dead and the others exit")


@dataclass(frozen=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
