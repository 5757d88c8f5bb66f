"""The assembled model's parameters from abstract shapes (`nnx.eval_shape`, nothing allocated):
the micro param tree as a snapshot, the hero's counts against OLMo-core's own
`OLMoDDPModelConfig.num_params` for the same config (goldens.runtime.models), and the hero's
whole state dict (keys and shapes) against OLMo-core's model built on the meta device."""

import jax
import numpy as np
import pytest
from flax import nnx
from syrupy.extensions.json import JSONSnapshotExtension

from goldens.runtime.models import model_config
from model import config as c
from model.convert import model_entries, params_to_olmo_core
from model.transformer import Transformer


def _abstract(model_cfg: c.ModelConfig) -> Transformer:
    return nnx.eval_shape(
        lambda: Transformer(
            model_cfg,
            ignore_segment_ids=True,
            kda_inverse="forward_substitution",
            rngs=nnx.Rngs(0),
        )
    )


def _counts(model_cfg: c.ModelConfig) -> tuple[int, int]:
    """(total, active) from the abstract param tree: routed experts count top_k of E."""
    moe = model_cfg.moe
    total = routed = 0
    for path, v in nnx.to_flat_state(nnx.state(_abstract(model_cfg), nnx.Param)):
        size = int(np.prod(v.get_value().shape))
        total += size
        routed += size if "routed_experts" in path else 0
    return total, total - routed * (moe.num_experts - moe.top_k) // moe.num_experts


def test_micro_param_tree_snapshot(snapshot):
    tree = {
        "/".join(map(str, path)): [list(v.get_value().shape), str(v.get_value().dtype)]
        for path, v in nnx.to_flat_state(nnx.state(_abstract(c.micro().model), nnx.Param))
    }
    assert tree == snapshot.use_extension(JSONSnapshotExtension)


@pytest.mark.parametrize("preset", [c.olmo35_tiny, c.micro], ids=lambda p: p.__name__)
def test_param_counts_from_abstract_shapes_match_olmo_core(preset):
    """olmo35_tiny: exactly 12,496,341,632 total and 794,233,472 active, as the hero's logs and
    OLMo-core's config; micro: OLMo-core's counts too."""
    model_cfg = preset().model
    olmo_core = model_config(model_cfg)
    ours = _counts(model_cfg)
    assert ours == (olmo_core.num_params, olmo_core.num_active_params)
    assert ours == (model_cfg.num_params(), model_cfg.num_active_params())
    if preset is c.olmo35_tiny:
        assert ours == (12_496_341_632, 794_233_472)


def test_abstract_model_allocates_nothing():
    leaves = jax.tree.leaves(nnx.state(_abstract(c.olmo35_tiny().model)))
    assert leaves and all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)


def test_hero_state_dict_matches_olmo_core_meta_build():
    """OLMo-core builds the hero on the meta device (KDA stand-ins for FLA's imports): its state
    dict has exactly the keys and shapes our abstract model gives through the weight map, and
    its parameters sum to the hero's count."""
    from goldens.runtime.standins import install

    install()
    model_cfg = c.olmo35_tiny().model
    meta = model_config(model_cfg).build(init_device="meta")
    theirs = {k: tuple(v.shape) for k, v in meta.state_dict().items()}
    zeros = jax.tree.map(
        lambda s: np.broadcast_to(np.zeros((), s.dtype), s.shape),
        nnx.state(_abstract(model_cfg), nnx.Param),
    )
    ours = {k: v.shape for k, v in params_to_olmo_core(zeros, model_entries(model_cfg)).items()}
    assert ours == theirs
    assert sum(int(np.prod(s)) for s in theirs.values()) == 12_496_341_632
