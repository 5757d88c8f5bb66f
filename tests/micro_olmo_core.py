"""The micro model with the weights of OLMo-core's whole-model goldens (goldens/model_*): the
trained micro model of the golden trace."""

from goldens.model import WEIGHTS
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
    return from_olmo_core(golden(WEIGHTS).tensors, CFG)
