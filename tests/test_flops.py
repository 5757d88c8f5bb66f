"""Model FLOPs by named scope (`model.flops.scope_flops`): they sum to the module docstring's
formula over the config's parameter counts, and each scope of weights does 6 FLOPs a token per
parameter of the model's own parameter tree under it (routed experts: top_k of num_experts)."""

import math

import pytest
from flax import nnx

from model import config as c
from model.flops import UNSCOPED, scope_flops, step_flops
from model.state import abstract_params

PRESETS = {"micro": c.micro, "slice": c.olmo35_slice, "hero": c.olmo35_tiny}


def _tokens(cfg: c.Config) -> int:
    return cfg.train.global_batch_size * cfg.train.seq_len


@pytest.mark.parametrize("preset", PRESETS)
def test_the_scopes_sum_to_the_docstrings_formula(preset):
    cfg = PRESETS[preset]()
    m, T = cfg.model, cfg.train.seq_len
    n = m.num_active_params() - m.vocab_size * m.d_model
    h, C, K, V = m.kda.n_heads, m.kda.chunk_size, m.kda.head_dim, m.kda.head_v_dim
    per_layer = {
        "attention": 2 * T * m.attention.n_heads * m.attention.head_dim,
        "kda": h * (3 * C * K + 2 * C * V + C**2 / 3 + 6 * K * V),
    }
    mixers = sum(per_layer[t] for t in m.layer_types)
    expected = 3 * _tokens(cfg) * (2 * n + mixers)
    assert sum(scope_flops(cfg).values()) == pytest.approx(expected, rel=1e-12)
    assert step_flops(cfg) == sum(scope_flops(cfg).values())


def _scope(path: tuple, cfg: c.Config) -> str | None:
    """The named scope that multiplies by the parameter at `path` (None: the embedding table,
    a lookup)."""
    if path[0] == "embeddings":
        return None
    if path[:2] == ("lm_head", "w_out"):
        return "vocab_loss"
    if path[0] != "blocks":
        return UNSCOPED
    block, part = path[1], path[2]
    if part == "attention":
        return cfg.model.layer_types[block]
    if part == "feed_forward" and block in cfg.model.moe_layers:
        return {"routed_experts_router": "router", "routed_experts": "grouped_matmul"}.get(
            path[3], "moe"
        )
    return UNSCOPED


@pytest.mark.parametrize("preset", PRESETS)
def test_each_scope_of_weights_counts_the_models_parameters(preset):
    cfg = PRESETS[preset]()
    m = cfg.model
    _, params = abstract_params(cfg)
    scopes = ("vocab_loss", "kda", "attention", "router", "grouped_matmul", "moe", UNSCOPED)
    counted = dict.fromkeys(scopes, 0.0)
    for path, leaf in nnx.to_flat_state(params):
        scope = _scope(path, cfg)
        if scope is not None:
            counted[scope] += math.prod(leaf.shape)
    counted["grouped_matmul"] *= m.moe.top_k / m.moe.num_experts
    flops = {scope: 6 * _tokens(cfg) * n for scope, n in counted.items()}
    attention_core = 2 * cfg.train.seq_len * m.attention.n_heads * m.attention.head_dim
    flops["attention"] += 3 * _tokens(cfg) * m.layer_types.count("attention") * attention_core
    got = scope_flops(cfg)
    assert {scope: got[scope] for scope in flops} == pytest.approx(flops, rel=1e-12)
