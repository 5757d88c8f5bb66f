"""The EMO router and its aux losses against OLMo-core's `EmoRouterV2` (goldens/router.safetensors):
document ids from EOS, per-document pools from OLMo-core's recorded draws, document scores, chosen
experts (exactly), weights, counts, LB and z-losses and their gradients, in training and evaluation;
pool ties as OLMo-core's `pool_keep_mask`; no token ever leaves its document's pool."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st

from goldens.router import moe_config
from goldens.tolerances import (
    DOCUMENT_SCORE_SUM_ORDER,
    FP32_FORWARD,
    FP32_GRAD,
    POOL_DRAW_COUNT_FLOOR,
)
from model.config import EmoConfig, MoEConfig, micro
from model.convert import load_olmo_core, router_entries
from model.moe import router_aux
from model.router import (
    Router,
    document_ids_from_eos,
    document_scores,
    draw_pools,
    pool_keep_mask,
    token_pools,
)
from tests.compare import assert_close

GOLDEN = "router.safetensors"
EOS = micro().model.eos_token_id


def test_review_row_document_ids():
    """The review's row: an EOS closes its own document, a leading EOS is a document."""
    row = jnp.array([[EOS, 5, 6, EOS, 7, EOS, EOS, 8, 9]])
    ids = document_ids_from_eos(row, eos_token_id=EOS)
    np.testing.assert_array_equal(ids, [[0, 1, 1, 1, 2, 2, 3, 4, 4]])


def test_document_ids_match_olmo_core(golden):
    """OLMo-core's `segment_ids_from_eos` on 40 rows of EOS rates 0 to 1, and on the router's."""
    g = golden("data/segment_ids.safetensors")
    ours = document_ids_from_eos(g["tokens"][:, :-1], eos_token_id=EOS)
    np.testing.assert_array_equal(ours, g["segment_ids"])
    r = golden(GOLDEN)
    np.testing.assert_array_equal(
        document_ids_from_eos(r["input_ids"], eos_token_id=EOS), r["segment_ids"]
    )


def _router(golden, config: MoEConfig):
    g = golden(GOLDEN)
    router = Router(config, g["x"].shape[-1], std=micro().model.init_std, rngs=nnx.Rngs(0))
    load_olmo_core(router, g.group("param."), router_entries())
    return g, router


@functools.partial(jax.jit, static_argnums=0)
def _route_with_grads(graphdef, state, x, document_ids, pools, cotangent, loss_div_factor):
    """Routing, LB and z-losses, and the gradients of sum(weights * cotangent), LB and z with
    respect to the router state and x."""
    config = nnx.merge(graphdef, state).config

    def objectives(state, x):
        routing = nnx.merge(graphdef, state)(x, document_ids=document_ids, pools=pools)
        aux = router_aux(
            routing,
            num_experts=config.num_experts,
            top_k=config.top_k,
            loss_div_factor=loss_div_factor,
        )
        losses = {"lb": aux.lb_loss, "z": aux.z_loss}
        values = {"weights": jnp.sum(routing.weights * cotangent), **losses}
        return values, (routing, aux.counts, values)

    grads, aux = jax.jacrev(objectives, argnums=(0, 1), has_aux=True)(state, x)
    return *aux, grads


def test_training_routing_matches_olmo_core(golden):
    """With OLMo-core's recorded draws: the same pools per token, document scores, experts and
    counts exactly, weights, LB and z-losses, and the gradients of each."""
    g, router = _router(golden, moe_config())
    seg, draws = g["segment_ids"], g["train.pool_draws"]
    np.testing.assert_array_equal(token_pools(draws, seg, emo=router.config.emo), g["train.pools"])
    probs = jax.nn.softmax(g["x"] @ g["param.weight"].reshape(16, -1).T, axis=-1)
    assert_close(
        "document_scores",
        expected=g["train.document_scores"],
        actual=document_scores(probs, seg),
        tol=FP32_FORWARD,
    )
    graphdef, state = nnx.split(router)
    routing, counts, values, grads = _route_with_grads(
        graphdef,
        state,
        g["x"],
        seg,
        draws,
        g["train.cotangent"],
        float(g.entry["config"]["loss_div_factor"]),
    )
    np.testing.assert_array_equal(routing.indices, g["train.indices"])
    unpooled = jax.lax.top_k(probs, router.config.top_k)[1]
    assert np.any(unpooled != g["train.indices"]), "the pools change no choice: a weak golden"
    np.testing.assert_array_equal(counts, g["train.counts"])
    assert_close("weights", expected=g["train.weights"], actual=routing.weights, tol=FP32_FORWARD)
    assert_close(
        "losses",
        expected={k: g[f"train.{k}_loss"][0] for k in ("lb", "z")},
        actual={k: values[k] for k in ("lb", "z")},
        tol=FP32_FORWARD,
    )
    for name in ("weights", "lb", "z"):
        assert_close(
            f"grad.{name}",
            expected={"x": g[f"train.grad.{name}.x"], "weight": g[f"train.grad.{name}.weight"]},
            actual={"x": grads[name][1], "weight": grads[name][0]["weight"][...]},
            tol=FP32_GRAD,
        )


def test_eval_routing_matches_olmo_core(golden):
    """Evaluation: every document keeps the eval pool (4 of 16 here); same experts exactly."""
    g, router = _router(golden, moe_config())
    routing = nnx.jit(lambda r, x, s: r(x, document_ids=s))(router, g["x"], g["segment_ids"])
    np.testing.assert_array_equal(routing.indices, g["eval.indices"])
    assert_close("weights", expected=g["eval.weights"], actual=routing.weights, tol=FP32_FORWARD)


def test_pool_ties_match_olmo_core(golden):
    """Document scores with many exact ties keep the same experts as OLMo-core's
    `pool_keep_mask` (lower index first on a CPU with 16 experts)."""
    g = golden(GOLDEN)
    keep = pool_keep_mask(g["ties.document_scores"], g["ties.pools"])
    np.testing.assert_array_equal(keep, g["ties.keep"])


B, T, D, E, K = 2, 32, 16, 16, 2
PROPERTY_MOE = MoEConfig(
    num_experts=E,
    top_k=K,
    expert_hidden=8,
    latent_dim=8,
    shared_expert_hidden=None,
    emo=EmoConfig(min_pool=K, max_pool=E, eval_pool=E),
)
PROPERTY_ROUTER = Router(PROPERTY_MOE, D, std=micro().model.init_std, rngs=nnx.Rngs(3))


@jax.jit
def _property_route(x, input_ids, pools):
    document_ids = document_ids_from_eos(input_ids, eos_token_id=0)
    routing = PROPERTY_ROUTER(x, document_ids=document_ids, pools=pools)
    return document_ids, routing


@settings(max_examples=200)
@given(
    eos=st.lists(st.booleans(), min_size=B * T, max_size=B * T),
    pools=st.lists(st.integers(K, E), min_size=B * T, max_size=B * T),
    seed=st.integers(0, 2**16),
)
def test_no_token_leaves_its_document_pool(eos, pools, seed):
    """For random documents, draws and router inputs: the experts a document's tokens use are at
    most its pool in number, and each is among its pool best by document score (float64)."""
    x = np.random.default_rng(seed).standard_normal((B, T, D), dtype=np.float32)
    input_ids = np.where(np.reshape(eos, (B, T)), 0, 1)
    pools = np.reshape(pools, (B, T))
    document_ids, routing = _property_route(x, input_ids, pools)
    probs = np.asarray(routing.probs, np.float64)
    for b in range(B):
        for d in np.unique(document_ids[b]):
            tokens = np.asarray(document_ids[b]) == d
            used = np.unique(np.asarray(routing.indices)[b][tokens])
            pool = pools[b, d]
            assert len(used) <= pool
            score = probs[b][tokens].sum(0)
            pool_floor = np.sort(score)[::-1][pool - 1]
            assert np.all(score[used] >= pool_floor - DOCUMENT_SCORE_SUM_ORDER), (b, d, used, pool)


def test_drawn_pools_cover_the_range():
    """Pools from a key are integers uniform in [min_pool, max_pool], both ends included."""
    emo = micro().model.moe.emo
    pools = draw_pools(jax.random.key(0), (64, 256), emo=emo)
    assert pools.shape == (64, 256) and pools.dtype == jnp.int32
    values, counts = np.unique(pools, return_counts=True)
    np.testing.assert_array_equal(values, np.arange(emo.min_pool, emo.max_pool + 1))
    assert counts.min() > POOL_DRAW_COUNT_FLOOR * pools.size / len(values)
