"""The micro model with the weights of OLMo-core's whole-model goldens (goldens/model_*), which
are not stored but regenerated from the gradients' shapes (OLMo-core's state dict)."""

from goldens.model import trained_like_weights
from model.config import micro
from model.convert import from_olmo_core

CFG = micro().model


def golden_gradients(golden) -> dict:
    """Every parameter's golden gradient, by OLMo-core key."""
    grads = {}
    for n in range(CFG.n_layers):
        grads.update(golden(f"model_grads_{n}.safetensors").group("grad."))
    return grads


def olmo_core_model(golden):
    """`from_olmo_core` of the goldens' OLMo-core weights."""
    shapes = {k: v.shape for k, v in golden_gradients(golden).items()}
    return from_olmo_core(trained_like_weights(shapes, d_model=CFG.d_model), CFG)
