"""OLMo-core state dicts <-> NNX params, through one explicit table of (OLMo-core key, NNX path,
layout). Loading checks that the key sets match exactly and every shape agrees before it assigns
anything; errors name the key. Arrays may be numpy, torch tensors or anything `np.asarray` takes
(torch itself is never imported here).

Public API: `from_olmo_core(state_dict, cfg)` -> `model.transformer.Transformer` and
`to_olmo_core(model)` -> state dict, through `model_entries(cfg)`, built from the component tables.

Layouts: "linear" is OLMo-core's weight [out, in] vs our kernel [in, out]; "conv" is a depthwise
conv weight [C, 1, W] vs ours [C, W]; "same" is unchanged. Values are converted to the dtype of the
param they fill (float64 in a float64 model, float32 otherwise); exporting keeps the params' dtype.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass

import jax
import numpy as np
from flax import nnx

from model.block import NORMS
from model.config import Flags, ModelConfig
from model.transformer import Transformer

LAYOUTS = ("linear", "conv", "same")


@dataclass(frozen=True)
class Entry:
    torch_key: str
    path: tuple[str | int, ...]
    layout: str = "same"


def _linear(torch_name: str, path: tuple, *, bias: bool = False) -> list[Entry]:
    entries = [Entry(f"{torch_name}.weight", (*path, "kernel"), "linear")]
    return entries + ([Entry(f"{torch_name}.bias", (*path, "bias"))] if bias else [])


def kda_entries(prefix: str = "", path: tuple = ()) -> list[Entry]:
    """`KimiDeltaAttention` (olmo_core/nn/attention/kda.py) <-> `model.kda.KimiDeltaAttention`."""
    entries = [Entry(f"{prefix}{n}", (*path, n)) for n in ("A_log", "dt_bias")]
    entries.append(Entry(f"{prefix}o_norm.weight", (*path, "o_norm")))
    for name in ("w_q", "w_k", "w_v", "f_proj_1", "f_proj_2", "w_b", "g_proj_1", "w_out"):
        entries += _linear(f"{prefix}{name}", (*path, name))
    entries += _linear(f"{prefix}g_proj_2", (*path, "g_proj_2"), bias=True)
    for name in ("q_conv1d", "k_conv1d", "v_conv1d"):
        entries.append(Entry(f"{prefix}{name}.weight", (*path, name, "weight"), "conv"))
    return entries


def attention_entries(prefix: str = "", path: tuple = ()) -> list[Entry]:
    """`Attention` (olmo_core/nn/attention/__init__.py) <-> `model.attention.Attention`."""
    entries = [Entry(f"{prefix}ssmax_scale", (*path, "ssmax_scale"))]
    for name in ("q_norm", "k_norm"):
        entries.append(Entry(f"{prefix}{name}.weight", (*path, name, "weight")))
    for name in ("w_q", "w_k", "w_v", "w_g", "w_out"):
        entries += _linear(f"{prefix}{name}", (*path, name))
    return entries


def router_entries(prefix: str = "", path: tuple = ()) -> list[Entry]:
    """`MoERouterV2` / `EmoRouterV2` (olmo_core/nn/moe/v2/) <-> `model.router.Router`; the weight
    stays flat [E * d_model]."""
    return [Entry(f"{prefix}weight", (*path, "weight"))]


def shared_expert_entries(prefix: str = "", path: tuple = ()) -> list[Entry]:
    """`SharedExperts` with one expert (olmo_core/nn/moe/v2/shared_experts.py) <->
    `model.moe.SharedExpert`; both weights keep OLMo-core's layout."""
    return [Entry(f"{prefix}{n}", (*path, n)) for n in ("w_up_gate", "w_down")]


def moe_entries(prefix: str = "", path: tuple = ()) -> list[Entry]:
    """The MoE weights of an `OLMoDDPTransformerBlock` (block-level names) <->
    `model.moe.LatentMoE`; routed expert weights keep OLMo-core's [E, 2H, L] and [E, H, L]."""
    entries = router_entries(f"{prefix}routed_experts_router.", (*path, "routed_experts_router"))
    entries += shared_expert_entries(f"{prefix}shared_experts.", (*path, "shared_experts"))
    for name in ("w_up_gate", "w_down"):
        entries.append(Entry(f"{prefix}routed_experts.{name}", (*path, "routed_experts", name)))
    for name in ("latent_down_proj", "latent_up_proj"):
        entries += _linear(f"{prefix}{name}", (*path, name))
    return entries


def _to_ours(array: np.ndarray, layout: str) -> np.ndarray:
    if layout == "linear":
        return array.T
    if layout == "conv":
        return array[:, 0, :]
    if layout == "same":
        return array
    raise NotImplementedError(layout)


def _to_olmo_core(array: np.ndarray, layout: str) -> np.ndarray:
    if layout == "linear":
        return array.T
    if layout == "conv":
        return array[:, None, :]
    if layout == "same":
        return array
    raise NotImplementedError(layout)


def _numpy(value, dtype) -> np.ndarray:
    if hasattr(value, "detach"):  # a torch tensor
        value = value.detach().cpu().numpy()
    return np.asarray(value, dtype=dtype)


def _flat_params(state: nnx.State) -> dict[tuple, np.ndarray]:
    return {path: np.asarray(v.get_value()) for path, v in nnx.to_flat_state(state)}


def load_olmo_core(module: nnx.Module, state_dict: Mapping, entries: list[Entry]) -> None:
    """Assign an OLMo-core state dict to `module`'s params by `entries`, each value converted to
    its param's dtype; all checks come first. `module` may be abstract (`nnx.eval_shape`): only
    its param shapes and dtypes are read."""
    ours = {path: v.get_value() for path, v in nnx.to_flat_state(nnx.state(module, nnx.Param))}
    by_key = {e.torch_key: e for e in entries}
    unknown = sorted(set(state_dict) - set(by_key))
    missing = sorted(set(by_key) - set(state_dict))
    if unknown or missing:
        raise KeyError(f"OLMo-core state dict: unknown keys {unknown}, missing keys {missing}")
    unmapped = sorted(set(ours) - {e.path for e in entries})
    if unmapped:
        raise KeyError(f"params with no OLMo-core key: {unmapped}")
    converted = {}
    for key, entry in by_key.items():
        want = ours[entry.path]
        value = _to_ours(_numpy(state_dict[key], want.dtype), entry.layout)
        if value.shape != want.shape:
            raise ValueError(
                f"{key}: shape {value.shape} after the {entry.layout!r} layout, "
                f"expected {want.shape} for {'.'.join(map(str, entry.path))}"
            )
        converted[entry.path] = value
    nested: dict = {}
    for path, value in converted.items():
        node = nested
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = value
    nnx.update(module, nested)


def param_path(tree_path: tuple) -> tuple:
    """The `Entry.path` of a leaf of a params state, from its `jax.tree_util` key path (the
    state's keys; the last key is the Variable's value)."""
    return tuple(getattr(k, "key", None) for k in tree_path[:-1])


def like_params(state_dict: Mapping, params: nnx.State, entries: list[Entry]) -> nnx.State:
    """Tensors shaped like OLMo-core's params (Adam moments, gradients), keyed as its state dict,
    as a state like `params` (each in its param's layout and dtype; a new state, `params` is
    untouched)."""
    by_path = {e.path: e for e in entries}

    def convert(path, leaf):
        entry = by_path[param_path(path)]
        value = _to_ours(_numpy(state_dict[entry.torch_key], leaf.dtype), entry.layout)
        if value.shape != leaf.shape:
            raise ValueError(f"{entry.torch_key}: shape {value.shape}, expected {leaf.shape}")
        return value

    return jax.device_put(jax.tree_util.tree_map_with_path(convert, params))


def params_to_olmo_core(params: nnx.State, entries: list[Entry]) -> dict[str, np.ndarray]:
    """Params (or gradients shaped like them) as an OLMo-core state dict."""
    flat = _flat_params(params)
    return {e.torch_key: _to_olmo_core(flat[e.path], e.layout) for e in entries}


def block_entries(config: ModelConfig, index: int) -> list[Entry]:
    """Block `index` of `OLMoDDPModel` (`blocks.<i>.`) <-> `model.block.Block`: mixer, four
    peri-norms, and the feed-forward, whose OLMo-core keys sit at block level."""
    prefix, path = f"blocks.{index}.", ("blocks", index)
    mixer = {"kda": kda_entries, "attention": attention_entries}[config.layer_types[index]]
    entries = mixer(f"{prefix}attention.", (*path, "attention"))
    entries += [Entry(f"{prefix}{n}.weight", (*path, n, "weight")) for n in NORMS]
    if index in config.dense_layers:
        return entries + shared_expert_entries(f"{prefix}shared_experts.", (*path, "feed_forward"))
    return entries + moe_entries(prefix, (*path, "feed_forward"))


def model_entries(config: ModelConfig) -> list[Entry]:
    """The whole `OLMoDDPModel` <-> `model.transformer.Transformer`."""
    entries = [
        Entry("embeddings.weight", ("embeddings",)),
        Entry("embedding_norm.weight", ("embedding_norm", "weight")),
        Entry("lm_head.norm.weight", ("lm_head", "norm", "weight")),
        *_linear("lm_head.w_out", ("lm_head", "w_out")),
    ]
    for index in range(config.n_layers):
        entries += block_entries(config, index)
    return entries


def from_olmo_core(state_dict: Mapping, cfg: ModelConfig, *, flags: Flags | None = None):
    """An OLMo-core `OLMoDDPModel` state dict -> `Transformer` in `cfg.compute_dtype` (float64
    params for "float64": compare with OLMo-core's model after `.to(torch.float64)`). `flags` sets
    the mixers' switches; None is OLMo-core's behaviour (mixers see the whole instance). No random
    init: the module is built from abstract shapes and every param comes from the state dict."""
    model = abstract_transformer(cfg, flags or Flags(olmoe3_mixers_ignore_segment_ids=True))
    load_olmo_core(model, state_dict, model_entries(cfg))
    return model


@functools.cache
def _abstract_parts(cfg: ModelConfig, flags: Flags, x64: bool) -> tuple[nnx.GraphDef, nnx.State]:
    """`x64` (JAX's x64 mode when traced) only keys the cache: the traced dtypes follow it."""
    return nnx.split(nnx.eval_shape(lambda: Transformer.of(cfg, flags, rngs=nnx.Rngs(0))))


def abstract_transformer(cfg: ModelConfig, flags: Flags) -> Transformer:
    """A new `Transformer` of `cfg` with abstract params (`jax.ShapeDtypeStruct`s), nothing
    allocated. Its init is traced once per config, flags and x64 mode (tracing it takes
    seconds); each call copies it."""
    x64 = jax.dtypes.canonicalize_dtype(np.float64) == np.float64
    return nnx.merge(*_abstract_parts(cfg, flags, x64), copy=True)


def to_olmo_core(model) -> dict[str, np.ndarray]:
    """A `Transformer`'s params as an OLMo-core `OLMoDDPModel` state dict, in the params' dtype."""
    return params_to_olmo_core(nnx.state(model, nnx.Param), model_entries(model.config))
