"""Peri-norm blocks of the micro model against OLMo-core's `OLMoDDPTransformerBlock`
(goldens/block_*.safetensors): a KDA block with the dense SwiGLU, a KDA block and an attention
block with the latent MoE (OLMo-core's recorded pool draws, its router losses attached): output,
input gradient and the gradient of every block parameter."""

import functools

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from goldens.blocks import BLOCKS, TOLERANCES
from goldens.model import LB_WEIGHT, ROUTER_Z_WEIGHT
from model.convert import model_entries, params_to_olmo_core
from model.router import document_ids_from_eos
from tests.compare import assert_close
from tests.micro_olmo_core import CFG, olmo_core_model


@functools.partial(jax.jit, static_argnums=(0, 1))
def _block_vjp(graphdef, index, state, x, input_ids, pool_draws, cotangent, div):
    """y of block `index` and the gradients of sum(y * cotangent) + the weighted router losses
    w.r.t. the model state (zero outside the block) and x."""

    def objective(state, x):
        model = nnx.merge(graphdef, state)
        document_ids = document_ids_from_eos(input_ids, eos_token_id=CFG.eos_token_id)
        y, aux = model.blocks[index](
            x, document_ids=document_ids, pools=pool_draws, loss_div_factor=div
        )
        attached = 0.0 if aux is None else LB_WEIGHT * aux.lb_loss + ROUTER_Z_WEIGHT * aux.z_loss
        return jnp.sum(y * cotangent) + attached, y

    (_, y), grads = jax.value_and_grad(objective, argnums=(0, 1), has_aux=True)(state, x)
    return y, grads


@pytest.fixture(scope="module")
def model(golden):
    return olmo_core_model(golden)


@pytest.mark.parametrize("kind", list(BLOCKS))
def test_block_matches_olmo_core(golden, model, kind):
    g = golden(f"block_{kind}.safetensors")
    index = g.entry["config"]["block_index"]
    pool_draws = g["pool_draws"] if "pool_draws" in g.tensors else None
    graphdef, state = nnx.split(model)
    y, (grad_state, grad_x) = _block_vjp(
        graphdef,
        index,
        state,
        g["x"],
        g["input_ids"],
        pool_draws,
        g["cotangent"],
        g.entry["config"]["loss_div_factor"],
    )
    forward, grad = TOLERANCES[kind]
    assert_close("y", expected=g["y"], actual=y, tol=forward)
    prefix = f"blocks.{index}."
    ours = {
        k: v
        for k, v in params_to_olmo_core(grad_state, model_entries(CFG)).items()
        if k.startswith(prefix)
    }
    assert_close("grad", expected=g.group("grad."), actual={"x": grad_x, **ours}, tol=grad)
