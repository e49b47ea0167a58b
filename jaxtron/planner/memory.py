"""Per-device memory of a layout, predicted without devices.

Parameters and optimizer state are exact: every parameter's shape and logical axes come from
`eval_shape` of the model, and the same rules table that shards a run (`sharding/rules.py`)
divides each dimension by its mesh degrees. Gradients take the parameters' layout (ZeRO-2 adds
the data axis), twice over when they are summed across microbatches (accumulation, and the
pipeline's per-tick backward). Activations follow Korthikanti et al. 2022 ("Reducing
Activation Recomputation in Large Transformer Models", section 4) adapted to this model and
checked against what JAX saves for the backward (`saved_residuals` of one block): per layer and
token the block keeps, in the compute dtype,

    2 D / r      both norms' inputs (r = tensor degree with sequence parallelism)
    2 n D / r    what each norm's derivative keeps: n = 1 for RMSNorm (x / rms), 3 for
                 LayerNorm (x - mean twice, and the normalised x)
    2 D / r      both norms' outputs (with sequence parallelism XLA keeps them split and gathers
                 them again in the backward: the per-layer slope of its memory says so)
    2 H K / t    the query and the attention output
    2 G K / t'   keys and values (t' = 1 when the kv heads are replicated over tensor)
    3 F / t      SwiGLU: gate, up and their product (gpt2: 2 F / t, GELU's input and output;
                 `models/activations.py` writes their derivatives from the inputs alone)

and no dropout masks. No attention implementation keeps [L, L] scores (flash-style, they keep
the output and a log-sum-exp per row), ring attention (a `sequence` axis) included; all-to-all
context parallelism keeps k and v at the heads it exchanged, max(G', n) of them.
`remat: full` keeps only each block's input (D / r); `save_dots` keeps the matmul outputs;
`offload` keeps nothing on the device (the block input and attention's output wait in host
memory, `offloaded_bytes`). The
backward of a block needs 1-2 blocks' worth of working memory on top: the activations it
consumes (kept or recomputed) and their gradients, as the intercept of XLA's memory against
depth shows (BACKWARD_WORKING_BLOCKS), one more under `remat: full`, whose backward holds a
block's recomputed activations beside their gradients; FSDP adds the weights of two blocks,
gathered for the forward and for the backward. A pipeline rank keeps its stage input for each
microbatch in flight and re-runs the stage from it in the backward, so it holds one stage's
activations at a time, and the embedding and head whole (gathered from their stage slices).
The loss adds fp32 logits and their gradient, [tokens, V / t], or one chunk of them with the
chunked loss.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxtron.config.checks import kv_heads_per_rank
from jaxtron.config.schema import Config
from jaxtron.errors import ConfigError
from jaxtron.kernels.dropless_experts import receive_rows
from jaxtron.models.moe import capacity
from jaxtron.models.transformer import Transformer
from jaxtron.pipeline.schedules import build_table
from jaxtron.planner.layout import Layout
from jaxtron.sharding.rules import logical_names, optimizer_rules, param_rules


@dataclasses.dataclass(frozen=True)
class Memory:
    params: int
    optimizer: int
    gradients: int
    activations: int
    logits: int

    @property
    def total(self) -> int:
        return self.params + self.optimizer + self.gradients + self.activations + self.logits


@functools.lru_cache(maxsize=8)
def _parameter_shapes(model_key) -> list[tuple[tuple[int, ...], tuple, int, bool]]:
    """(shape, logical names, bytes per element, whether in the repeated block stack) of every
    parameter of the model (a dense prefix is stacked too, but a pipeline treats it as an end:
    gathered whole for the first stage)."""

    model_config, moe_config = model_key
    abstract = nnx.eval_shape(lambda: Transformer(model_config, rngs=nnx.Rngs(0), moe=moe_config))
    out = []
    for path, var in nnx.to_flat_state(nnx.state(abstract, nnx.Param)):
        value = var.get_value()
        out.append((tuple(value.shape), logical_names(var), np.dtype(value.dtype).itemsize,
                    path[0] == "blocks"))
    return out


def _shapes(config: Config):
    return _parameter_shapes((config.model, config.moe))


def _sharded_elements(shape, names, rules, degrees, stage: int) -> float:
    count = 1.0
    end = stage > 1 and "layers" not in names  # embedding, head: split over stages too
    for dim, (size, name) in enumerate(zip(shape, names)):
        if name == "layers" and stage > 1:
            count *= math.ceil(size / stage)  # the stack is split over pipeline ranks
            continue
        if end and dim == 0:  # [N, ...] -> [p, ceil(N / (p w)) w, ...], w ways over the mesh
            ways = math.prod(degrees[a] for a in rules.get(name, ()) if a in degrees)
            count *= math.ceil(size / (stage * ways))
            continue
        split = math.prod(degrees[a] for a in rules.get(name, ()) if a in degrees)
        count *= size / split if size % split == 0 else size  # kv heads replicate
    return count


def gathered_block_bytes(config: Config, layout: Layout) -> float:
    """Bytes of one block's weights as FSDP gathers them (split by tensor and expert only)."""
    degrees = {**layout.degrees(), "fsdp": 1}
    return _param_bytes(config, degrees, 1, "layers") / config.model.num_layers


def end_bytes(config: Config, layout: Layout) -> int:
    """Bytes on one device of the parameters outside the repeated block stack (embedding, head,
    final norm, a dense prefix, multi-token prediction) as the mesh splits them, before a
    pipeline splits them over its stages."""
    return int(_param_bytes(config, layout.degrees(), 1, "ends"))


def expert_gradient_bytes(config: Config, layout: Layout) -> int:
    """The part of this device's gradient bytes that belongs to routed experts (split over the
    `expert` axis; the rest is replicated over it, like data parallelism)."""
    return int(_param_bytes(config, layout.degrees(), layout.stage, "expert"))


_KEPT: dict[tuple, tuple] = {}


def _kept(config: Config, key: tuple, compute):
    """`compute()`, kept by `key` and the identity of the config's model and MoE sections: the
    planner asks a million times, and hashing the model config would cost more than the
    answer. A kept answer is used only while those very sections are alive and asked again."""
    full = (id(config.model), id(config.moe)) + key
    kept = _KEPT.get(full)
    if kept is not None and kept[0] is config.model and kept[1] is config.moe:
        return kept[2]
    if len(_KEPT) > 65536:
        _KEPT.clear()
    answer = compute()
    _KEPT[full] = (config.model, config.moe, answer)
    return answer


def _param_bytes(config: Config, degrees: dict, stage: int, which: str) -> float:
    """Bytes on one device, by the parameter rules, of the parameters `which` names: those with
    a `layers` or an `expert` axis, or the ends (outside the repeated block stack)."""
    def selected() -> float:
        rules = param_rules(config)
        return sum(itemsize * _sharded_elements(shape, names, rules, degrees, stage)
                   for shape, names, itemsize, stacked in _shapes(config)
                   if ((not stacked) if which == "ends" else which in names))
    return _kept(config, ("selected", tuple(degrees.items()), stage, which), selected)


def state_bytes(config: Config, layout: Layout,
                zero_stage: int | None = None) -> tuple[int, int, int]:
    """(parameters, Adam moments, gradients) bytes on one device; `zero_stage` in place of the
    layout's. The planner asks for every variant of a mesh (remat, microbatches,
    schedules...), which all hold the same state: it is worked out once per mesh."""
    zero = layout.zero_stage if zero_stage is None else zero_stage
    doubled = layout.grad_accum > 1 or layout.stage > 1
    degrees = (layout.stage, layout.data, layout.fsdp, layout.expert, layout.sequence,
               layout.tensor)
    return _kept(config, ("state", config.optim.moment_dtype, zero, degrees, doubled),
                 lambda: _state_bytes(config, config.optim.moment_dtype, zero,
                                      layout.degrees(), layout.stage, doubled))


def _state_bytes(config: Config, moment_dtype: str, zero_stage: int, degrees: dict,
                 stage: int, doubled: bool) -> tuple[int, int, int]:
    config = Config(model=config.model, moe=config.moe)
    config = dataclasses.replace(config, optim=dataclasses.replace(
        config.optim, zero_stage=zero_stage, moment_dtype=moment_dtype))
    prules, orules = param_rules(config), optimizer_rules(config)
    # ZeRO-2 reduce-scatters this rank's whole gradient once per step (as Megatron-LM's
    # distributed optimizer does): until then the rank holds all of it; with one data rank
    # there is nothing to scatter over and the optimizer rules change nothing.
    grules = prules
    params = moments = grads = 0.0
    moment_bytes = np.dtype(jnp.dtype(moment_dtype)).itemsize
    for shape, names, itemsize, stacked in _shapes(config):
        params += itemsize * _sharded_elements(shape, names, prules, degrees, stage)
        moments += 2 * moment_bytes * _sharded_elements(shape, names, orules, degrees, stage)
        grads += itemsize * _sharded_elements(shape, names, grules, degrees, stage)
    if doubled:
        grads *= 2  # the running sum and the microbatch's (a pipeline tick's) gradients
    return int(params), int(moments), int(grads)


# A block's backward holds its activations and the gradients flowing through them at once.
# XLA's memory at 4 and 8 layers, extrapolated to 0 layers, exceeds the rest of the prediction
# by one to two blocks' activations (about 1 with tensor=4, 2 with data=8; D = 128): a
# measured constant that splits the difference.
BACKWARD_WORKING_BLOCKS = 1.5


def offloaded_bytes(config: Config, layout: Layout) -> float:
    """Bytes `remat: offload` moves to host memory per microbatch pass and layer, and back:
    the block input (D / r a token), attention's output (H K / t) and its fp32 log-sum-exp
    (H / t)."""
    if layout.remat != "offload":
        return 0.0
    m, t = config.model, layout.tensor
    e = np.dtype(m.compute_dtype).itemsize
    r = t if layout.sequence_parallel else 1
    per_token = (e * m.d_model / r + e * m.num_heads * m.value_head_dim / t
                 + 4 * m.num_heads / t)
    return microbatch_tokens(config, layout) * per_token


def layer_activation_bytes(config: Config, layout: Layout, tokens: int, policy: str) -> float:
    """Bytes one block keeps for the backward, for `tokens` tokens of one sequence shard."""
    m = config.model
    e = np.dtype(m.compute_dtype).itemsize
    t = layout.tensor
    r = t if layout.sequence_parallel else 1
    kv_split = t if m.kv_heads % t == 0 else 1
    if policy == "full":
        return e * tokens * m.d_model / r
    if policy == "offload":  # kept in host memory (`offloaded_bytes`), none on the device
        return 0.0
    hk, gk = m.num_heads * m.resolved_head_dim, m.kv_heads * m.resolved_head_dim
    if layout.all_to_all_size > 1:
        # the kernel keeps k and v at the heads exchanged: repeated up to n when fewer
        gk = (max(kv_heads_per_rank(m, t), layout.all_to_all_size) * m.resolved_head_dim
              * kv_split)
    dots = 2 * hk / t + 2 * gk / kv_split + 2 * _mlp_width(config, layout) / t + 2 * m.d_model / r
    norm_saves = 1 if m.type == "llama" else 3
    full = (2 * (2 + norm_saves) * m.d_model / r + 2 * hk / t
            + 2 * gk / kv_split + (3 if m.type == "llama" else 2) * _mlp_width(config, layout) / t)
    per_token = dots if policy == "save_dots" else full
    moe_layers = 1 / config.moe.every if config.moe.enabled else 0.0  # MoE blocks per block
    moe_rows = _moe_routing_elements(config, layout)
    if config.moe.enabled and layout.expert > 1 and policy != "full":
        # Under expert parallelism the SwiGLU input of the exchanged rows is kept once more.
        moe_rows += _expert_slots(config, layout) * (config.moe.expert_mlp_dim or m.mlp_dim) / t
    return e * tokens * (per_token + moe_layers * moe_rows)


def _slotted(config: Config, layout: Layout) -> bool:
    """Whether experts run on fixed slots (capacity mode)."""
    return config.moe.mode == "capacity"


def _capacity(config: Config, layout: Layout) -> int:
    moe = config.moe
    return capacity(config.data.seq_len, moe.top_k, moe.num_experts, moe.capacity_factor)


def dropless_buffer_rows(config: Config, layout: Layout) -> int:
    """Rows of a rank's receive buffer in the dropless exchange (`dropless_experts`)."""
    moe = config.moe
    return receive_rows(microbatch_tokens(config, layout), moe.top_k, layout.expert,
                        moe.num_experts // layout.expert, moe.ep_buffer_factor)


def _expert_slots(config: Config, layout: Layout) -> float:
    """Expert rows computed per token: top_k (dropless on one rank), the receive buffer's rows
    (dropless under expert parallelism), or every expert's slots, E x C / L (slotted experts
    compute their slots whether filled or not)."""
    moe = config.moe
    if _slotted(config, layout):
        return moe.num_experts * _capacity(config, layout) / config.data.seq_len
    if layout.expert > 1:
        return dropless_buffer_rows(config, layout) / microbatch_tokens(config, layout)
    return moe.top_k


def _mlp_width(config: Config, layout: Layout) -> float:
    moe = config.moe
    if moe.enabled:  # per token: the routed expert rows and the shared experts
        expert = moe.expert_mlp_dim or config.model.mlp_dim
        return (_expert_slots(config, layout) + moe.shared_experts) * expert
    return config.model.mlp_dim


def _moe_routing_elements(config: Config, layout: Layout) -> float:
    """Per token, what an MoE layer keeps beyond its expert hidden rows: each expert row's input
    and output. Slotted experts move tokens by gather on integer slot indices (negligible);
    XLA gathers the k outputs back from the kept slot buffer in the backward rather than
    keeping them (the compiled memory says so)."""
    if not config.moe.enabled:
        return 0.0
    return 2 * _expert_slots(config, layout) * config.model.d_model


def expert_block_bytes(config: Config, layout: Layout) -> float:
    """One MoE layer's routed-expert weights on this device."""
    return (_param_bytes(config, layout.degrees(), 1, "expert")
            / (config.moe.stacked_layers(config.model.num_layers) // config.moe.every))


def microbatch_sequences(config: Config, layout: Layout) -> int:
    return config.train.batch_size // (layout.batch_split * layout.grad_accum
                                       * (layout.microbatches if layout.stage > 1 else 1))


def microbatch_tokens(config: Config, layout: Layout) -> int:
    """Tokens of one microbatch on one device (its sequence shard)."""
    return microbatch_sequences(config, layout) * config.data.seq_len // layout.sequence


def schedule_table(schedule: str, stages: int, microbatches: int, virtual: int,
                   recompute: bool):
    """The tick table a layout runs (built once per shape by `build_table`)."""
    return build_table(schedule, stages, microbatches, virtual, recompute)


def layout_table(layout: Layout):
    return schedule_table(layout.schedule, layout.stage, layout.microbatches,
                          layout.virtual_stages, layout.recompute)


def predict(config: Config, layout: Layout) -> Memory:
    """Per-device bytes of `config` run under `layout`."""
    return with_state(config, state_bytes(config, layout), activation_bytes(config, layout))


def with_state(config: Config, state: tuple[int, int, int],
               activations: tuple[int, int]) -> Memory:
    """A layout's memory from its state (`state_bytes`) and its (activations, logits)
    (`activation_bytes`)."""
    params, moments, grads = state
    activations, logits = activations
    if config.optim.host_moments:
        # In host memory between steps; on the device only for the update, when the
        # activations and logits are gone: only what exceeds them raises the peak.
        moments = max(0, moments - activations - logits)
    return Memory(params, moments, grads, activations, logits)


def activation_bytes(config: Config, layout: Layout) -> tuple[int, int]:
    """(activations, fp32 logits and their gradient) bytes per device: the same whatever the
    layout's ZeRO stage."""
    m = config.model
    e = np.dtype(m.compute_dtype).itemsize
    tokens = microbatch_tokens(config, layout)
    layers = math.ceil(m.num_layers / layout.stage)
    blocks = BACKWARD_WORKING_BLOCKS + (1 if layout.remat in ("full", "offload") else 0)
    unsaved = layer_activation_bytes(config, layout, tokens, "none")  # what a block makes
    working = blocks * unsaved
    if layout.fsdp > 1:  # one block's weights gathered for the forward, one for the backward
        working += 2 * gathered_block_bytes(config, layout)
    if config.moe.enabled:
        # The layer's expert weight gradients before they join the stacked sum, twice; the
        # dropless grouped matmul's backward adds one per sequence (a batch of ragged dots).
        grouped = not _slotted(config, layout)
        per_sequence = (0 if not grouped else 1 if layout.expert > 1  # one dot over the buffer
                        else microbatch_sequences(config, layout))
        working += 2 * (1 + per_sequence) * expert_block_bytes(config, layout)
    kept = (unsaved if layout.remat == "none"
            else layer_activation_bytes(config, layout, tokens, layout.remat))
    if layout.stage > 1:
        table = layout_table(layout)
        in_flight = (layout.microbatches if layout.schedule == "gpipe"
                     else min(layout.microbatches, layout.stage * layout.virtual_stages))
        if layout.schedule == "zbv":  # chunk inputs held, as its greedy table places them
            in_flight = table.act_slots
        stage_input = e * tokens * m.d_model
        chunk = math.ceil(layers / layout.virtual_stages)
        # + the embedding and head gathered whole from their stage slices, on every rank
        activations = in_flight * stage_input + chunk * kept + working + end_bytes(config,
                                                                                   layout)
        # Slotted values a rank holds at once: its table's slots and the one a job returns
        # before it is written into its slot.
        if table.split:  # B's stashes (a chunk's activations)
            activations += (table.w_slots + 1) * chunk * unsaved
        if not layout.recompute or table.recomputes:  # residuals from F or R until B
            # the ends' behind their conditionals too: norms and the head's logits
            ends = e * tokens * 3 * m.d_model + 4 * tokens * m.vocab_size / layout.tensor
            activations += (table.res_slots + 1) * (chunk * kept + ends)
    else:
        activations = layers * kept + working
    vocab = m.vocab_size / layout.tensor
    loss_tokens = (min(tokens, m.loss_chunk_tokens) if m.cross_entropy == "chunked" else tokens)
    logits = 2 * 4 * loss_tokens * vocab
    return int(activations), int(logits)


def memory_budget_bytes(text: str) -> int:
    """'80GiB', '141GB', '512MiB' or a number of bytes -> bytes."""
    units = {"tib": 2**40, "gib": 2**30, "mib": 2**20, "kib": 2**10, "tb": 1e12, "gb": 1e9,
             "mb": 1e6, "kb": 1e3, "b": 1}
    lowered = text.strip().lower()
    number, scale = lowered, 1
    for unit, unit_scale in units.items():
        if lowered.endswith(unit):
            number, scale = lowered[: -len(unit)], unit_scale
            break
    try:
        value = float(number)
    except ValueError:
        raise ConfigError(f"--device-memory {text!r} is not an amount of memory; give a number "
                          "with a unit, e.g. 80GiB, 141GB or 512MiB.") from None
    if not value > 0:
        raise ConfigError(f"--device-memory {text!r} must be positive, e.g. 80GiB.")
    return int(value * scale)


