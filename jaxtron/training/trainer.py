"""Everything a run needs between a config and a loop: mesh, sharded state, jitted steps.

    trainer = Trainer(config)
    state = trainer.init_state()
    for batch in batches:
        state, metrics = trainer.step(state, trainer.put_batch(batch))

Shardings come from `eval_shape` of the initialiser and the rules table; the state is created
directly in place by one jit with those output shardings (no host copy of the weights), and the
step is jitted once with the state donated.
"""

from __future__ import annotations

import contextlib

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jaxtron.checkpoint.params import load_exported_params
from jaxtron.config.checks import check_layout
from jaxtron.config.platforms import building_for, for_platform, platform_of
from jaxtron.config.schema import Config
from jaxtron.data.windows import batch_keys
from jaxtron.errors import ConfigError
from jaxtron.kernels import fp8
from jaxtron.kernels.choice import configured_kernel, cudnn_present
from jaxtron.models.transformer import Transformer
from jaxtron.runtime.cpu_matmuls import compiler_options, keep_until_exit
from jaxtron.sharding.context_parallel import context_parallel, ring_size
from jaxtron.sharding.mesh import build_mesh
from jaxtron.sharding.rules import (
    activation_rules,
    activation_sharding,
    check_rules,
    optimizer_rules,
    param_rules,
    spec_for,
    variable_shardings,
)
from jaxtron.training.data_parallel import reduce_once
from jaxtron.training.optimizers import build_optimizer, learning_rate
from jaxtron.training.stages import StagedModel
from jaxtron.training.step import (
    TrainState,
    accumulated_grads,
    counted_tokens_mean,
    make_eval_step,
    make_loss_fn,
    make_train_step,
    plain_grads,
    returning_grads,
)


class Trainer:
    def __init__(self, config: Config, devices=None, platform: str | None = None):
        """`platform` (cpu, cuda, rocm, tpu) is what the step is built for: by default that of
        the mesh's devices. Another one is for lowering checks on this machine (`--dry-run
        --target`): `model.dtype: auto` and the attention kernels follow it."""
        self.mesh = build_mesh(config.mesh, devices)
        self.platform = platform or platform_of(self.mesh.devices.flat[0])
        self.config = config = for_platform(config, self.platform)
        configured_kernel(config, self.platform, cudnn_present())  # what it cannot run: one line
        self.param_rules, self.activation_rules = param_rules(config), activation_rules(config)
        check_rules(self.param_rules)
        check_rules(self.activation_rules)
        check_layout(config, dict(self.mesh.shape))
        self.tx, self.schedule = build_optimizer(config), learning_rate(config)
        abstract_model = nnx.eval_shape(self._new_model)
        self.graphdef, _ = nnx.split(abstract_model)
        self.stages = (StagedModel(config, self.mesh) if config.mesh.stage > 1
                       else None)
        self.loss_fn = make_loss_fn(self.graphdef, ring_size(
            config.mesh.context_parallel, self.mesh.shape["sequence"],
            config.mesh.all_to_all_group))

        self._abstract = abstract = jax.eval_shape(self._init)  # traced once, reused below
        replicated = NamedSharding(self.mesh, PartitionSpec())
        self.state_shardings = self._shardings(abstract)
        self.batch_sharding = NamedSharding(self.mesh, spec_for(("batch", None),
                                                                self.activation_rules, self.mesh))
        grad_fn = self._grad_fn(abstract)
        self.compiler_options = options = compiler_options(self.mesh.devices)
        bias_rate = config.moe.bias_update_rate if config.moe.enabled else 0.0

        def make_step(grad_fn):
            return make_train_step(self.tx, self.schedule, grad_fn, bias_rate,
                                   config.optim.host_moments)

        self._step = jax.jit(make_step(grad_fn),
                             in_shardings=(self.state_shardings, self.batch_sharding),
                             out_shardings=(self.state_shardings, replicated),
                             donate_argnums=0, compiler_options=options)
        self._step_and_grads = jax.jit(
            returning_grads(make_step, grad_fn),
            in_shardings=(self.state_shardings, self.batch_sharding),
            out_shardings=(self.state_shardings, replicated, replicated,
                           self.state_shardings.params),
            donate_argnums=0, compiler_options=options)
        self._grads = jax.jit(grad_fn, in_shardings=(self.state_shardings.params,
                                                     self.batch_sharding),
                              compiler_options=options)
        # A pipeline evaluates through its stages (a forward-only schedule), layers in place.
        eval_fn = self.stages.eval_loss if self.stages else make_eval_step(self.loss_fn)
        self._eval = jax.jit(eval_fn, in_shardings=(self.state_shardings.params,
                                                    self.batch_sharding),
                             out_shardings=replicated, compiler_options=options)
        if options:
            keep_until_exit(self._step, self._step_and_grads, self._grads, self._eval)

    def _grad_fn(self, abstract: TrainState):
        """Gradients of one step: accumulated over `optim.grad_accum` microbatches, and with
        more than one data-parallel rank reduced over `data` once per step (reduce-scattered
        like the optimizer state under ZeRO-2), see `sharding/data_parallel.py`."""
        c = self.config
        grad_fn = self.stages.value_and_grad if self.stages else plain_grads(self.loss_fn)
        if c.optim.grad_accum > 1:
            grad_fn = accumulated_grads(grad_fn, c.optim.grad_accum)
        zero2 = c.optim.zero_stage >= 2
        parts = c.optim.grad_accum  # the loss each gradient sees: 1/parts of the step's
        if self.mesh.shape["data"] > 1 and (zero2 or c.optim.grad_accum > 1):
            scatter_like = (variable_shardings(abstract.params, optimizer_rules(c), self.mesh)
                            if zero2 else None)
            grad_fn = reduce_once(grad_fn, self.mesh,
                                  variable_shardings(abstract.params, self.param_rules,
                                                     self.mesh), scatter_like)
            parts *= self.mesh.shape["data"]

        def step_grads(params, batch):
            with fp8.gradient_parts(parts):
                return grad_fn(params, counted_tokens_mean(batch))

        return step_grads

    def _shardings(self, abstract: TrainState) -> TrainState:
        """Parameters by the parameter rules, optimizer state by the (ZeRO) optimizer rules,
        in pinned host memory with `optim.host_moments`."""
        opt_state = variable_shardings(abstract.opt_state, optimizer_rules(self.config),
                                       self.mesh)
        if self.config.optim.host_moments:
            opt_state = jax.tree.map(lambda s: s.with_memory_kind("pinned_host"), opt_state,
                                     is_leaf=lambda x: isinstance(x, NamedSharding))
        return TrainState(
            step=NamedSharding(self.mesh, PartitionSpec()),
            params=variable_shardings(abstract.params, self.param_rules, self.mesh),
            opt_state=opt_state)

    def _new_model(self) -> Transformer:
        return Transformer(self.config.model, rngs=nnx.Rngs(self.config.train.seed),
                           moe=self.config.moe)

    def _initial_params(self) -> nnx.State:
        """The new model's parameters, in the model's own layout."""
        return nnx.state(self._new_model(), nnx.Param)

    def _fresh_state(self, params: nnx.State) -> TrainState:
        """Step 0 around `params` (model layout): stacked into pipeline stages where the run
        has them, with the optimizer's initial state."""
        if self.stages:
            params = self.stages.to_pipeline_params(params)
        return TrainState(step=jax.numpy.zeros((), jax.numpy.int32), params=params,
                          opt_state=self.tx.init(params))

    def _init(self) -> TrainState:
        return self._fresh_state(self._initial_params())

    def init_state(self) -> TrainState:
        """A fresh state, created on the mesh with its final shardings."""
        with self._tracing():
            return jax.jit(self._init, out_shardings=self.state_shardings)()

    @contextlib.contextmanager
    def _tracing(self):
        with (activation_sharding(self.mesh, self.activation_rules),
              building_for(self.platform),
              context_parallel(self.config.mesh.context_parallel,
                               self.config.mesh.all_to_all_group)):
            yield

    def compile_step(self, state: TrainState, batch: dict, compiler_options=None):
        """Ahead-of-time compile the step for these shapes (for timing and memory analysis);
        `compiler_options`: XLA's options for this compile, over XLA_FLAGS."""
        with self._tracing():
            compiled = self._step.lower(state, batch).compile(compiler_options)
        if self.compiler_options:
            keep_until_exit(compiled)
        return compiled

    def lower_step(self):
        """The step lowered from abstract shapes for the platform it is built for, without
        compiling: how a step for GPUs or TPUs is checked on a CPU machine."""
        with self._tracing():
            traced = self._step.trace(self.abstract_state(), self.abstract_batch())
        return traced.lower(lowering_platforms=(self.platform,))

    def step(self, state: TrainState, batch: dict) -> tuple[TrainState, dict]:
        with self._tracing():
            return self._step(state, batch)

    def step_and_grads(self, state: TrainState, batch: dict):
        """The step, returning as well the objective and gradients it applied (of `state`'s
        parameters): one program where a check that compares both would otherwise compile a
        gradient pass of its own. -> (state, metrics, objective, grads)"""
        with self._tracing():
            return self._step_and_grads(state, batch)

    def loss_and_grads(self, params, batch: dict):
        """The step's objective and gradients, without updating anything (for checks)."""
        with self._tracing():
            (objective, _), grads = self._grads(params, batch)
            return objective, grads

    def abstract_state(self) -> TrainState:
        """Shapes, dtypes and shardings of the state, without allocating it."""
        return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                            self._abstract, self.state_shardings)

    def abstract_batch(self) -> dict:
        """Shapes of a global batch: the keys `data.packing` and `data.eod_mask_loss` add."""
        batch = self.config.train.batch_size
        return {key: jax.ShapeDtypeStruct((batch, *row), dtype, sharding=self.batch_sharding)
                for key, (row, dtype) in batch_keys(self.config).items()}

    def eval_loss(self, state: TrainState, batch: dict) -> jax.Array:
        with self._tracing():
            return self._eval(state.params, batch)

    def local_rows(self) -> slice:
        """The rows of every global batch that this process's devices hold: all of them for one
        process, a contiguous share per host when the batch axes span hosts."""
        shape = (self.config.train.batch_size, self.config.data.seq_len + 1)
        held = self.batch_sharding.addressable_devices_indices_map(shape).values()
        covered = set()
        for rows, *_ in held:
            covered.update(range(*rows.indices(shape[0])[:2]))
        start, stop = min(covered), max(covered) + 1
        if len(covered) != stop - start:
            raise ConfigError(
                f"this process's devices hold rows {sorted(covered)} of the batch, which are not "
                "one contiguous block; make the cross-host part of the batch axes explicit with "
                "mesh.dcn_data / mesh.dcn_fsdp so each host holds one block.")
        return slice(start, stop)

    def put_batch(self, local_batch: dict) -> dict:
        """This process's rows -> global arrays sharded over the batch axes of the mesh."""
        return {k: jax.make_array_from_process_local_data(self.batch_sharding, np.asarray(v))
                for k, v in local_batch.items()}

    def canonical_state(self, state: TrainState) -> TrainState:
        """The state in the model's own layout (what checkpoints hold, whatever the mesh)."""
        if not self.stages:
            return state
        return _convert_layout(state, self.stages.to_model_params)

    def abstract_canonical_state(self) -> TrainState:
        """Restore target of a checkpoint: canonical shapes with this mesh's shardings."""
        if not self.stages:
            return self.abstract_state()
        abstract = jax.eval_shape(lambda: self.canonical_state(self._init()))
        return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                            abstract, self._shardings(abstract))

    def from_canonical_state(self, state: TrainState) -> TrainState:
        if not self.stages:
            return state

        def convert(state):
            return _convert_layout(state, self.stages.to_pipeline_params)

        return jax.jit(convert, out_shardings=self.state_shardings)(state)

    def with_params(self, state: TrainState, params) -> TrainState:
        """`state` with its parameters replaced by `params` (model layout), placed on the mesh."""
        def replace(state, params):
            if self.stages:
                params = self.stages.to_pipeline_params(params)
            return state.replace(params=params)
        return jax.jit(replace, out_shardings=self.state_shardings)(state, params)

    def params_from(self, path) -> nnx.State:
        """The parameters of an exported checkpoint (`jaxtron.export`, `jaxtron.convert`),
        placed on this mesh in the model's own layout (what `with_params` takes)."""
        return load_exported_params(path, self.abstract_canonical_state().params, self.config)

    def to_model_params(self, params):
        """The model's own parameter layout (undoes the pipeline layout, if any)."""
        return self.stages.to_model_params(params) if self.stages else params

    def model(self, state: TrainState) -> Transformer:
        """The NNX model with the state's parameters, for inspection or generation."""
        return nnx.merge(self.graphdef, self.to_model_params(state.params))


def _convert_layout(state: TrainState, convert) -> TrainState:
    """Apply a parameter-layout conversion to the parameters and to every optimizer-state tree
    shaped like them (Adam's moments)."""
    opt_state = jax.tree.map(
        lambda x: convert(x) if isinstance(x, nnx.State) and "blocks" in x else x,
        state.opt_state, is_leaf=lambda x: isinstance(x, nnx.State))
    return TrainState(step=state.step, params=convert(state.params), opt_state=opt_state)
