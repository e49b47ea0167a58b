"""The Transformer as the three functions a pipeline runs: embed, a chunk of blocks, head + loss.

With `mesh.stage > 1` the stacked block parameters are kept in the pipeline layout
`[p, v, Lmax, ...]` (logical axes `stage, layers, layers, ...`), so each rank stores only its own
layers and their optimizer state; `to_model_params` restores the model's `[N, ...]` layout for
evaluation, export and generation. The pipeline package itself knows nothing of the model.
"""

from __future__ import annotations

import jax
from flax import nnx

from jaxtron.config import Config
from jaxtron.models import Transformer, cross_entropy_loss
from jaxtron.models.transformer import run_blocks
from jaxtron.pipeline.engine import pipeline_value_and_grad
from jaxtron.pipeline.layout import split_layers
from jaxtron.pipeline.schedule import build_table


class PipelinedTransformer:
    def __init__(self, config: Config, mesh):
        c = config
        self.config, self.mesh = c, mesh
        self.layout = split_layers(c.model.num_layers, c.mesh.stage, c.pipeline.virtual_stages,
                                   c.pipeline.layers_per_stage)
        self.table = build_table(c.pipeline.schedule, c.mesh.stage, c.pipeline.microbatches,
                                 c.pipeline.virtual_stages)
        model = nnx.eval_shape(lambda: Transformer(c.model, rngs=nnx.Rngs(0), moe=c.moe))
        self.embedder_def = nnx.graphdef(model.embedder)
        self.blocks_def = nnx.graphdef(model.blocks)
        self.head_def = nnx.graphdef(model.head)
        self._value_and_grad = pipeline_value_and_grad(
            self.table, mesh, self._first, self._stage, self._last)

    # -- parameter layouts ----------------------------------------------------------------

    def to_pipeline_params(self, params: nnx.State) -> nnx.State:
        def convert(var):
            # [p, v, Lmax]: the rank, then two axes of the layer stack.
            names = ("stage", "layers") + tuple(var.get_metadata()["out_sharding"])
            return var.replace(self.layout.to_pipeline(var.get_value()), out_sharding=names)
        return self._map_blocks(params, convert)

    def to_model_params(self, params: nnx.State) -> nnx.State:
        def convert(var):
            names = tuple(var.get_metadata()["out_sharding"])[2:]
            return var.replace(self.layout.from_pipeline(var.get_value()), out_sharding=names)
        return self._map_blocks(params, convert)

    @staticmethod
    def _map_blocks(params, fn):
        blocks = jax.tree.map(fn, params["blocks"], is_leaf=lambda x: isinstance(x, nnx.Variable))
        return nnx.State({**dict(params.items()), "blocks": blocks})

    # -- the three stage functions -----------------------------------------------------------

    def _first(self, embedder_params, tokens_BxL):
        return nnx.merge(self.embedder_def, embedder_params)(tokens_BxL)

    def _stage(self, chunk_params, active_L, x_BxLxD):
        x_BxLxD, _ = run_blocks(self.config.model, self.blocks_def, chunk_params, x_BxLxD,
                                active_L)
        return x_BxLxD

    def _last(self, last_params, x_BxLxD, targets_BxL):
        table = last_params["table"][...] if self.config.model.tied_embeddings else None
        logits = nnx.merge(self.head_def, last_params["head"])(x_BxLxD, table)
        return cross_entropy_loss(logits, targets_BxL)

    # -- gradients ---------------------------------------------------------------------------

    def value_and_grad(self, params: nnx.State, tokens):
        """Mean loss and gradients (pipeline layout) of the batch `tokens_Bx(L+1)`."""
        m = self.config.pipeline.microbatches
        batch, width = tokens.shape
        # Microbatch i takes rows i, i + m, ...: each data-parallel shard stays on its devices.
        tokens_MxBxT = tokens.reshape(batch // m, m, width).swapaxes(0, 1)
        tied = self.config.model.tied_embeddings
        last = {"head": params["head"]}
        if tied:
            last["table"] = params["embedder"]["embed"]
        active = jax.numpy.asarray(self.layout.active)
        loss, (g_first, g_blocks, g_last) = self._value_and_grad(
            params["embedder"], params["blocks"], last, active, tokens_MxBxT[..., :-1],
            tokens_MxBxT[..., 1:])
        if tied:  # the table is used twice: embedding on the first stage, head on the last
            g_first = nnx.State({**dict(g_first.items()),
                                 "embed": jax.tree.map(jax.numpy.add, g_first["embed"],
                                                       g_last["table"])})
        return (loss, {"loss": loss}), nnx.State({"embedder": g_first, "blocks": g_blocks,
                                                 "head": g_last["head"]})
