"""The tensor table of a Hugging Face checkpoint: every HF tensor's name, where it lives in
jaxtron's parameters, and its shape in each layout (see `jaxtron.hf.translate` for the layouts)."""

from __future__ import annotations

import math

import numpy as np

from jaxtron.hf.arch import MIXTRAL

FLAT = -1  # a tensor table row's "input dims" for a bias: our [H, K] is HF's flat [H * K]


def rope_order(width: int) -> np.ndarray:
    """HF DeepSeek's interleave-to-halves order: our rotary row j is HF's row rope_order(width)[j]."""
    return np.concatenate([np.arange(0, width, 2), np.arange(1, width, 2)])


def tensor_table(dims: dict) -> list[tuple]:
    """Every tensor as (hf name, our path, index into our array, our full shape, input dims).

    `input dims` is how many leading axes of the indexed slice are a Linear's input (0: a norm
    vector, copied as it is). `dims` holds N D H G K F V E (0 for a dense model), `arch`, and
    per family: `qk_norm`, `mla` (Q C Kn Kr Vh), `shared` (width of the shared experts),
    `bias` (a router bias). DeepSeek's kv_b_proj appears as two halves, `:k` and `:v`."""
    n, d, h, g, k, f, v, e = (dims[c] for c in "NDHGKFVE")
    arch, mla = dims["arch"], dims.get("mla")
    rows = [("model.embed_tokens.weight", ("embedder", "embed"), (), (v, d), 0),
            ("model.norm.weight", ("head", "final_norm", "scale"), (), (d,), 0)]
    if not dims.get("tied"):  # tied: the head is the embedding table
        rows.append(("lm_head.weight", ("head", "lm_head"), (), (d, v), 1))
    first_dense = dims.get("first_dense", 0)
    for i in range(n):
        # DeepSeek-V3's first layers are dense: a stack of their own ("dense_blocks").
        dense_layer = i < first_dense
        stack, j, cnt = (("dense_blocks", i, first_dense) if dense_layer
                         else ("blocks", i - first_dense, n - first_dense))
        p, a = f"model.layers.{i}.", (stack, "attn")
        rows += [(p + "input_layernorm.weight", (stack, "attn_norm", "scale"), (j,), (cnt, d), 0),
                 (p + "post_attention_layernorm.weight", (stack, "mlp_norm", "scale"), (j,),
                  (cnt, d), 0)]
        if mla:
            q, c, kn, kr, vh = (mla[x] for x in ("Q", "C", "Kn", "Kr", "Vh"))
            s = p + "self_attn."
            if q:
                rows += [(s + "q_a_proj.weight", a + ("wq_down",), (j,), (cnt, d, q), 1),
                         (s + "q_a_layernorm.weight", a + ("q_norm",), (j,), (cnt, q), 0),
                         (s + "q_b_proj.weight", a + ("wq_up",), (j,), (cnt, q, h, kn + kr), 1)]
            else:
                rows.append((s + "q_proj.weight", a + ("wq",), (j,), (cnt, d, h, kn + kr), 1))
            rows += [(s + "kv_a_proj_with_mqa.weight", a + ("wkv_down",), (j,), (cnt, d, c + kr),
                      1),
                     (s + "kv_a_layernorm.weight", a + ("kv_norm",), (j,), (cnt, c), 0),
                     (s + "kv_b_proj.weight:k", a + ("wk_up",), (j,), (cnt, c, h, kn), 1),
                     (s + "kv_b_proj.weight:v", a + ("wv_up",), (j,), (cnt, c, h, vh), 1),
                     (s + "o_proj.weight", a + ("wo",), (j,), (cnt, h, vh, d), 2)]
        else:
            rows += [(p + "self_attn.q_proj.weight", a + ("wq",), (j,), (cnt, d, h, k), 1),
                     (p + "self_attn.k_proj.weight", a + ("wk",), (j,), (cnt, d, g, k), 1),
                     (p + "self_attn.v_proj.weight", a + ("wv",), (j,), (cnt, d, g, k), 1),
                     (p + "self_attn.o_proj.weight", a + ("wo",), (j,), (cnt, h, k, d), 2)]
            if dims.get("qkv_bias"):  # Qwen2
                rows += [(p + f"self_attn.{x}_proj.bias", a + (f"b{x}",), (j,), (cnt, n_, k),
                          FLAT) for x, n_ in (("q", h), ("k", g), ("v", g))]
        if dims.get("qk_norm"):
            rows += [(p + f"self_attn.{x}_norm.weight", a + (f"{x}_norm",), (j,), (cnt, k), 0)
                     for x in "qk"]
        if not e or dense_layer:
            w = dims["dense_F"] if dense_layer else f
            rows += [(p + f"mlp.{hf}_proj.weight", (stack, "mlp", ours), (j,), shape, 1)
                     for hf, ours, shape in (("gate", "w_gate", (cnt, d, w)),
                                             ("up", "w_up", (cnt, d, w)),
                                             ("down", "w_down", (cnt, w, d)))]
            continue
        m = (stack, "mlp")
        if arch == MIXTRAL:
            rows.append((p + "block_sparse_moe.gate.weight", m + ("router",), (j,), (cnt, d, e), 1))
            names, experts = ("w1", "w3", "w2"), p + "block_sparse_moe.experts."
        else:
            rows.append((p + "mlp.gate.weight", m + ("router",), (j,), (cnt, d, e), 1))
            names, experts = ("gate_proj", "up_proj", "down_proj"), p + "mlp.experts."
        for x in range(e):
            q_ = f"{experts}{x}."
            rows += [(q_ + names[0] + ".weight", m + ("w_gate",), (j, x), (cnt, e, d, f), 1),
                     (q_ + names[1] + ".weight", m + ("w_up",), (j, x), (cnt, e, d, f), 1),
                     (q_ + names[2] + ".weight", m + ("w_down",), (j, x), (cnt, e, f, d), 1)]
        if dims.get("bias"):
            rows.append((p + "mlp.gate.e_score_correction_bias", m + ("router_bias",), (j,),
                         (cnt, e), 0))
        if dims.get("shared"):
            s_ = dims["shared"]
            rows += [(p + f"mlp.shared_experts.{hf}_proj.weight", m + ("shared", ours), (j,),
                      shape, 1)
                     for hf, ours, shape in (("gate", "w_gate", (cnt, d, s_)),
                                             ("up", "w_up", (cnt, d, s_)),
                                             ("down", "w_down", (cnt, s_, d)))]
    return rows


def hf_shape(full_shape, index, input_dims) -> tuple[int, ...]:
    shape = full_shape[len(index):]
    if input_dims == FLAT:
        return (math.prod(shape),)
    if not input_dims:
        return tuple(shape)
    return (math.prod(shape[input_dims:]), math.prod(shape[:input_dims]))


def deepseek_rows(tensors: dict, dims: dict, *, to_ours: bool) -> dict:
    """DeepSeek's own rows <-> the table's: kv_b_proj split into its k and v halves, and the
    rotary rows reordered (`rope_order`) where the file interleaves them."""
    mla, h = dims["mla"], dims["H"]
    kn, kr, vh, c = mla["Kn"], mla["Kr"], mla["Vh"], mla["C"]
    order = rope_order(kr) if mla["interleave"] else np.arange(kr)
    if not to_ours:
        order = np.argsort(order)
    out = dict(tensors)
    for i in range(dims["N"]):
        s = f"model.layers.{i}.self_attn."
        q_name = s + ("q_b_proj.weight" if mla["Q"] else "q_proj.weight")
        for name, rows in ((q_name, None), (s + "kv_a_proj_with_mqa.weight", c)):
            if name not in out:
                continue
            w = np.asarray(out[name])
            if rows is None:  # q: [H * (Kn + Kr), X], rotary rows last in each head
                w = w.reshape(h, kn + kr, -1)
                w = np.concatenate([w[:, :kn], w[:, kn:][:, order]], axis=1).reshape(h * (kn + kr), -1)
            else:
                w = np.concatenate([w[:rows], w[rows:][order]], axis=0)
            out[name] = w
        if to_ours and s + "kv_b_proj.weight" in out:
            w = np.asarray(out.pop(s + "kv_b_proj.weight")).reshape(h, kn + vh, -1)
            out[s + "kv_b_proj.weight:k"] = w[:, :kn].reshape(h * kn, -1)
            out[s + "kv_b_proj.weight:v"] = w[:, kn:].reshape(h * vh, -1)
        elif not to_ours:
            k_part = out.pop(s + "kv_b_proj.weight:k").reshape(h, kn, -1)
            v_part = out.pop(s + "kv_b_proj.weight:v").reshape(h, vh, -1)
            out[s + "kv_b_proj.weight"] = np.ascontiguousarray(
                np.concatenate([k_part, v_part], axis=1).reshape(h * (kn + vh), -1))
    return out
