"""Peri-norm blocks and sequence mixers of the micro model against OLMo-core's through their fp64
oracles (goldens/oracle/{block,mixer}_*.safetensors), at OLMo-core's initial and trained weights:
a KDA block with the dense SwiGLU, a KDA block and an attention block with the latent MoE
(OLMo-core's recorded pool draws, its router losses attached), and the KDA and attention mixers
alone: output, input gradient and the gradient of every parameter.

Formula parity (float64 vs OLMo-core float64) and rounding parity (float32 vs that oracle, within a
multiple of OLMo-core float32's own error); a 1% change of one constant in one layer fails the
first and names that layer's tensors."""

import dataclasses

import jax
import pytest

from goldens.blocks import BLOCKS
from goldens.oracle import MIXERS
from tests.compare import assert_formula_parity, assert_rounding_parity
from tests.micro_olmo_core import WEIGHTS, block_outputs, mixer_outputs, olmo_core_model

CASES = [
    *(pytest.param(f"block_{k}", block_outputs, id=f"block_{k}") for k in BLOCKS),
    *(pytest.param(f"mixer_{k}", mixer_outputs, id=f"mixer_{k}") for k in MIXERS),
]
SEEDED_FAULT = 1.01
"""The gated output norm's eps of block 1's KDA, times this: a 1% change of one constant."""


@pytest.fixture(scope="module")
def models(golden):
    """Our models with OLMo-core's weights: {(weights, dtype): model}, float64 ones built under
    `jax.enable_x64`."""
    out = {}
    for weights in WEIGHTS:
        out[weights, "float32"] = olmo_core_model(golden, weights)
        with jax.enable_x64(True):
            out[weights, "float64"] = olmo_core_model(golden, weights, "float64")
    return out


@pytest.mark.parametrize("weights", list(WEIGHTS))
@pytest.mark.parametrize(("case", "outputs"), CASES)
def test_formula_parity_with_olmo_core_float64(golden, models, case, outputs, weights):
    oracle = golden(f"oracle/{case}_{weights}.safetensors")
    with jax.enable_x64(True):
        ours = outputs(models[weights, "float64"], oracle)
        assert_formula_parity(f"{case} at {weights} weights", oracle, ours)


@pytest.mark.parametrize("weights", list(WEIGHTS))
@pytest.mark.parametrize(("case", "outputs"), CASES)
def test_rounding_parity_with_olmo_core_float32(golden, models, case, outputs, weights):
    oracle = golden(f"oracle/{case}_{weights}.safetensors")
    ours = outputs(models[weights, "float32"], oracle)
    assert_rounding_parity(f"{case} at {weights} weights", oracle, ours)


def test_one_percent_eps_change_in_one_layer_fails_formula_parity(golden, models):
    """The power of formula parity: block 1's gated-norm eps times 1.01 (a change float32
    rounding would hide) fails it, naming block 1's output and gradients."""
    oracle = golden("oracle/block_kda_init.safetensors")
    with jax.enable_x64(True):
        model = olmo_core_model(golden, "init", "float64")
        kda = model.blocks[1].attention
        kda.config = dataclasses.replace(kda.config, norm_eps=kda.config.norm_eps * SEEDED_FAULT)
        ours = block_outputs(model, oracle)
        with pytest.raises(AssertionError) as failure:
            assert_formula_parity("block_kda with a seeded fault", oracle, ours)
    message = str(failure.value)
    for name in ("y", "grad.x", "grad.blocks.1.attention.o_norm.weight"):
        assert f"\n  {name}: relative error" in message, message
