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

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jaxtron.config import Config
from jaxtron.errors import ConfigError
from jaxtron.models import Transformer
from jaxtron.optim import build_optimizer, learning_rate
from jaxtron.sharding.mesh import build_mesh
from jaxtron.sharding.rules import (activation_rules, activation_sharding, check_rules,
                                    param_rules, spec_for, variable_shardings)
from jaxtron.step import (TrainState, accumulated_grads, make_eval_step, make_loss_fn,
                          make_train_step, plain_grads)


class Trainer:
    def __init__(self, config: Config, devices=None):
        self.config = config
        self.mesh = build_mesh(config.mesh, devices)
        self.param_rules, self.activation_rules = param_rules(config), activation_rules(config)
        check_rules(self.param_rules)
        check_rules(self.activation_rules)
        self._check_batch()
        self.tx, self.schedule = build_optimizer(config), learning_rate(config)
        abstract_model = nnx.eval_shape(self._new_model)
        self.graphdef, _ = nnx.split(abstract_model)
        self.loss_fn = make_loss_fn(self.graphdef)

        abstract_state = jax.eval_shape(self._init)
        self.state_shardings = variable_shardings(abstract_state, self.param_rules, self.mesh)
        self.batch_sharding = NamedSharding(self.mesh, spec_for(("batch", None),
                                                                self.activation_rules, self.mesh))
        replicated = NamedSharding(self.mesh, PartitionSpec())
        accum = config.optim.grad_accum
        grad_fn = (plain_grads(self.loss_fn) if accum == 1
                   else accumulated_grads(self.loss_fn, accum))
        self._step = jax.jit(make_train_step(self.tx, self.schedule, grad_fn),
                             in_shardings=(self.state_shardings, self.batch_sharding),
                             out_shardings=(self.state_shardings, replicated),
                             donate_argnums=0)
        self._eval = jax.jit(make_eval_step(self.loss_fn),
                             in_shardings=(self.state_shardings.params, self.batch_sharding),
                             out_shardings=replicated)

    def _check_batch(self) -> None:
        c = self.config
        split = self.mesh.shape["data"] * self.mesh.shape["fsdp"]
        micro = c.train.batch_size // c.optim.grad_accum
        if micro % split:
            raise ConfigError(
                f"each step's microbatch of train.batch_size / optim.grad_accum = {micro} "
                f"sequences must split evenly over mesh.data x mesh.fsdp = {split} devices; "
                f"make train.batch_size a multiple of {split * c.optim.grad_accum}.")
        if jax.process_count() > 1 and c.train.batch_size % jax.process_count():
            raise ConfigError(f"train.batch_size={c.train.batch_size} must divide evenly over "
                              f"{jax.process_count()} processes.")

    def _new_model(self) -> Transformer:
        return Transformer(self.config.model, rngs=nnx.Rngs(self.config.train.seed))

    def _init(self) -> TrainState:
        params = nnx.state(self._new_model(), nnx.Param)
        return TrainState(step=jax.numpy.zeros((), jax.numpy.int32), params=params,
                          opt_state=self.tx.init(params))

    def init_state(self) -> TrainState:
        """A fresh state, created on the mesh with its final shardings."""
        with self._tracing():
            return jax.jit(self._init, out_shardings=self.state_shardings)()

    def _tracing(self):
        return activation_sharding(self.mesh, self.activation_rules)

    def compile_step(self, state: TrainState, batch: dict):
        """Ahead-of-time compile the step for these shapes (for timing and memory analysis)."""
        with self._tracing():
            return self._step.lower(state, batch).compile()

    def step(self, state: TrainState, batch: dict) -> tuple[TrainState, dict]:
        with self._tracing():
            return self._step(state, batch)

    def eval_loss(self, state: TrainState, batch: dict) -> jax.Array:
        with self._tracing():
            return self._eval(state.params, batch)

    def put_batch(self, local_batch: dict) -> dict:
        """This process's rows -> global arrays sharded over the batch axes of the mesh."""
        return {k: jax.make_array_from_process_local_data(self.batch_sharding, np.asarray(v))
                for k, v in local_batch.items()}

    def model(self, state: TrainState) -> Transformer:
        """The NNX model with the state's parameters, for inspection or generation."""
        return nnx.merge(self.graphdef, state.params)
