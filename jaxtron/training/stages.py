"""The model cut into pipeline stages: the three pieces the model is composed of
(`models/transformer.py`: `embed`, `run_stack`, `head_loss`) as the functions the pipeline
engine runs on its ranks, and the parameter layout that splits them over the ranks.

With `mesh.stage > 1` every parameter is kept in a pipeline layout that stores 1/p of the model
(and of its optimizer state) on each rank:

    blocks      [N, ...] -> [p, v, Lmax, ...]   (stage, layers, layers, ...): each rank's layers
    embedder,   [n, ...] -> [p, ceil(n/p), ...] (stage, ...): split evenly by the first dimension
    head

The engine sends the embedder's slices to rank 0 and the head's to rank p - 1 before the loop,
the only ranks that embed or compute the loss (with `model.tied_embeddings` the table goes to
both), and returns each gradient slice to its owner after it: no parameter is replicated over
`stage` and no gradient is all-reduced over it. The loss is `Head.loss`, so
`model.cross_entropy=chunked` never forms the logits here either. Evaluation runs a forward-only
schedule through the same stages (`eval_loss`). `to_model_params` restores the model's own
layout for checkpoints, export and generation. The pipeline package itself knows nothing of the
model; this module is where the two meet.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jaxtron.config.schema import Config
from jaxtron.errors import ConfigError
from jaxtron.models import transformer
from jaxtron.pipeline.engine import pipeline_loss, pipeline_value_and_grad
from jaxtron.pipeline.layer_split import join_stages, split_layers, split_over_stages
from jaxtron.pipeline.schedules import build_table, forward_table
from jaxtron.sharding.rules import optimizer_rules, param_rules
from jaxtron.training.batch import (
    counted_tokens_mean,
    model_inputs,
    split_microbatches,
    token_positions,
)


def _is_variable(x) -> bool:
    return isinstance(x, nnx.Variable)


def _objective(aux: dict) -> dict:
    """A piece's aux as the engine takes it: the weighted auxiliary losses summed into
    `objective`, the rest as metrics."""
    aux = dict(aux)
    terms = aux.pop("weighted_terms", [])
    return {"objective": sum(terms, jnp.zeros((), jnp.float32)), **aux}


class StagedModel:
    def __init__(self, config: Config, mesh):
        c = config
        if c.pipeline.schedule == "auto":
            raise ConfigError("pipeline.schedule=auto is chosen by the command that starts the "
                              "run (python -m jaxtron.train, bench, --dry-run); a trainer built "
                              "in code needs a named schedule, e.g. pipeline.schedule=1f1b.")
        self.config, self.mesh = c, mesh
        p, v, m = c.mesh.stage, c.pipeline.virtual_stages, c.pipeline.microbatches
        # The stacked unit is a block, or for MoE every k-th layers a group of k blocks
        # ending in its MoE block: stages hold whole units.
        every = c.moe.every if c.moe.enabled else 1
        # Dense blocks in front of an MoE model's stack run on the first stage, after the
        # embedding: `layers_per_stage[0]` counts them.
        dense = c.moe.dense_prefix
        counts = c.pipeline.layers_per_stage
        if counts is not None:
            counts = (counts[0] - dense, *counts[1:])
        v_shape = c.pipeline.schedule == "zbv"  # chunks down the ranks and back up
        units = None if counts is None else tuple(n // every for n in counts)
        self.layer_split = split_layers(c.moe.stacked_layers(c.model.num_layers) // every, p, v,
                                        units, v_shape)
        self.table = build_table(c.pipeline.schedule, p, m, v, c.pipeline.recompute)
        # Evaluation cuts the batch as finely as a training step does (microbatches of every
        # accumulation step), so it never holds larger activations than training.
        self.eval_table = forward_table(p, m * c.optim.grad_accum, v, v_shape)
        model = nnx.eval_shape(
            lambda: transformer.Transformer(c.model, rngs=nnx.Rngs(0), moe=c.moe))
        self.embedder_def = nnx.graphdef(model.embedder)
        self.blocks_def = nnx.graphdef(model.blocks)
        self.head_def = nnx.graphdef(model.head)
        # What is not in the block stack: split evenly over the ranks and sent to its user.
        # Multi-token prediction's modules run after the head's input, on the last stage.
        self.ends = (("embedder", "head") + (("dense_blocks",) if dense else ())
                     + (("mtp",) if c.model.mtp_depth else ()))
        if dense:
            self.dense_def = nnx.graphdef(model.dense_blocks)
        if c.model.mtp_depth:
            self.mtp_def = nnx.graphdef(model.mtp)
        # The ends' Variables in the model layout: their shapes and logical axis names.
        self._model_ends = {name: nnx.state(getattr(model, name), nnx.Param)
                            for name in self.ends}
        self._rules = (param_rules(c), optimizer_rules(c))
        stage_fns = (self._first, self._stage, self._last)
        self._value_and_grad = pipeline_value_and_grad(self.table, mesh, *stage_fns,
                                                       recompute=c.pipeline.recompute)
        self._loss = pipeline_loss(self.eval_table, mesh, *stage_fns)

    # -- parameter layouts ----------------------------------------------------------------

    def to_pipeline_params(self, params: nnx.State) -> nnx.State:
        def blocks(var):
            # [p, v, Lmax]: the rank, then two axes of the layer stack.
            names = ("stage", "layers") + tuple(var.get_metadata()["out_sharding"])
            return var.replace(self.layer_split.to_pipeline(var.get_value()), out_sharding=names)

        def ends(var, model_var):
            names = tuple(model_var.get_metadata()["out_sharding"])
            value = split_over_stages(var.get_value(), self.config.mesh.stage,
                                      self._ways(names[0]))
            return var.replace(value, out_sharding=("stage",) + names)

        return self._convert(params, blocks, ends)

    def to_model_params(self, params: nnx.State) -> nnx.State:
        def blocks(var):
            names = tuple(var.get_metadata()["out_sharding"])[2:]
            return var.replace(self.layer_split.from_pipeline(var.get_value()), out_sharding=names)

        def ends(var, model_var):
            return model_var.replace(join_stages(var.get_value(), model_var.shape[0]))

        return self._convert(params, blocks, ends)

    def _ways(self, name) -> int:
        """Parts the rules split a dimension named `name` into, for parameters or their
        optimizer state: each rank's part of a split end must divide by it."""
        if name is None:
            return 1
        axes = {a for rules in self._rules for a in rules[name]}
        return math.prod(self.mesh.shape.get(a, 1) for a in axes)

    def _convert(self, params, blocks_fn, ends_fn) -> nnx.State:
        """`params` (or optimizer state shaped like them) with its blocks and ends converted.
        A masked entry (optax.partition's placeholder for the parameters another part of the
        optimizer updates, as Muon's and Adam's parts do) has no array to convert."""
        def unless_masked(fn):
            return lambda var, *rest: (var if isinstance(var.get_value(), optax.MaskedNode)
                                       else fn(var, *rest))

        converted = dict(params.items())
        converted["blocks"] = jax.tree.map(unless_masked(blocks_fn), params["blocks"],
                                           is_leaf=_is_variable)
        for name in self.ends:
            converted[name] = self._map_with_model(params[name], name, unless_masked(ends_fn))
        return nnx.State(converted)

    def _map_with_model(self, tree, name, fn):
        """fn(variable, the model-layout variable at the same path) over an end's tree."""
        model_vars = {jax.tree_util.keystr(path): var for path, var in
                      jax.tree_util.tree_flatten_with_path(self._model_ends[name],
                                                           is_leaf=_is_variable)[0]}
        return jax.tree_util.tree_map_with_path(
            lambda path, var: fn(var, model_vars[jax.tree_util.keystr(path)]), tree,
            is_leaf=_is_variable)

    def _split_ends(self, params):
        """(first, last, shared): what only rank 0, only rank p - 1, and both of them use.
        The last stage reads the embedding table for tied embeddings (its head) and for
        multi-token prediction (the modules embed tokens ahead)."""
        m = self.config.model
        embedder, shared = dict(params["embedder"].items()), {}
        if m.tied_embeddings or m.mtp_depth:
            shared["embed"] = embedder.pop("embed")
        first = {"embedder": nnx.State(embedder)}
        if "dense_blocks" in self.ends:
            first["dense_blocks"] = params["dense_blocks"]
        last = nnx.State({name: params[name] for name in self.ends
                          if name not in ("embedder", "dense_blocks")})
        return nnx.State(first), last, nnx.State(shared)

    def _whole(self, tree, name):
        """An end gathered by the engine, [p * K, ...] -> the model layout [n, ...]."""
        return self._map_with_model(
            tree, name, lambda var, model_var: model_var.replace(
                var.get_value()[:model_var.shape[0]]))

    # -- the three stage functions: the model's pieces on the engine's parameter trees --------

    def _first(self, first, shared, inputs):
        embedder = nnx.merge(self.embedder_def, self._whole(nnx.State(
            {**dict(first["embedder"].items()), **dict(shared.items())}), "embedder"))
        dense = (nnx.merge(self.dense_def, self._whole(first["dense_blocks"], "dense_blocks"))
                 if "dense_blocks" in first else None)
        return transformer.embed(self.config.model, embedder, dense, inputs["tokens"],
                                 token_positions(inputs))

    def _stage(self, chunk_params, active_L, x_BxLxD, inputs):
        c = self.config
        blocks = nnx.merge(self.blocks_def, chunk_params)
        x_BxLxD, aux = transformer.run_stack(c.model, c.moe if c.moe.enabled else None, blocks,
                                             x_BxLxD, token_positions(inputs), active_L)
        return x_BxLxD, _objective(aux)

    def _last(self, last, shared, x_BxLxD, targets):
        m = self.config.model
        head = nnx.merge(self.head_def, self._whole(last["head"], "head"))
        table_VxD = embedder = mtp = None
        if m.tied_embeddings or m.mtp_depth:  # the table reaches this stage as `shared`
            table_VxD = self._whole(shared, "embedder")["embed"][...]
        if m.mtp_depth:
            embedder = nnx.merge(self.embedder_def, self._whole(shared, "embedder"))
            mtp = nnx.merge(self.mtp_def, self._whole(last["mtp"], "mtp"))
        loss, aux = transformer.head_loss(
            m, head, mtp, x_BxLxD, targets.get("tokens"), targets["targets"],
            token_positions(targets), targets.get("weights"),
            table_VxD if m.tied_embeddings else None, embedder)
        return loss, _objective(aux)

    # -- loss and gradients ------------------------------------------------------------------

    def _arguments(self, params, batch: dict, m: int):
        x = model_inputs(batch)
        inputs = {"tokens": x.inputs_BxL, "positions": x.token_pos.positions,
                  "segment_ids": x.token_pos.segment_ids}
        targets = {"targets": x.targets_BxL, "weights": x.weights_BxL}
        if self.config.model.mtp_depth:  # the last stage's modules read the row itself
            targets.update(tokens=x.inputs_BxL, positions=x.token_pos.positions,
                           segment_ids=x.token_pos.segment_ids)
        present = lambda tree: {k: a for k, a in tree.items() if a is not None}  # noqa: E731
        active = jax.numpy.asarray(self.layer_split.active)
        return (*self._split_ends(params), params["blocks"], active,
                split_microbatches(present(inputs), m), split_microbatches(present(targets), m))

    def value_and_grad(self, params: nnx.State, batch: dict):
        """Mean loss and gradients (pipeline layout) of a batch (see `jaxtron.training.step`)."""
        (objective, metrics), (g_first, g_last, g_shared, g_blocks) = self._value_and_grad(
            *self._arguments(params, batch, self.table.microbatches))
        g_first = dict(g_first.items())
        g_embedder = {**dict(g_first.pop("embedder").items()), **dict(g_shared.items())}
        g_embedder = nnx.State({key: g_embedder[key] for key in params["embedder"]})
        return (objective, metrics), nnx.State({"embedder": g_embedder, "blocks": g_blocks,
                                                **g_first, **dict(g_last.items())})

    def eval_loss(self, params: nnx.State, batch: dict):
        """Mean loss of a batch through a forward-only pipeline schedule."""
        return self._loss(*self._arguments(params, counted_tokens_mean(batch),
                                           self.eval_table.microbatches))
