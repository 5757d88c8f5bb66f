"""Golden of OLMo-core's gated NoPE `Attention` (olmo_core/nn/attention/__init__.py), fp32, the
micro config's attention (2 query heads, 1 KV head, head dim 32, d_model 64), torch backend (SDPA).

`attention.safetensors`: input x [2, 256, 64], the weights (OLMo-core names), output y and the
gradients of sum(y * cotangent) (cotangent N(0, 1 / (B*T))) with respect to x and every weight.
Weights are drawn at trained-like scale: linear std 1/sqrt(fan_in), QK-norm gains 1 + N(0, 0.01),
scalable-softmax scales U(0.25, 0.75), so that the gate, the norms and the scales all matter.
`doc.*`: the query after QK norm and scalable softmax from OLMo-core's own `_prepare_qkv` with
`cu_doc_lens` (document-relative positions), on the first row cut into three documents; the
torch backend itself refuses intra-document masking on CPU.
"""

from __future__ import annotations

from goldens.runtime.models import ATTENTION_BACKEND, attention_config
from goldens.runtime.torch_layers import layer_vjp, to_numpy
from goldens.store import GoldenFile
from goldens.tolerances import FP32_FORWARD, FP32_GRAD, REGENERATE_COMPONENT
from model.config import micro

SEED = 5005
D_MODEL = micro().model.d_model
X_SHAPE = (2, 256, D_MODEL)
DOC_BOUNDS = (0, 37, 130, 256)
"""`cu_doc_lens` of the `doc.*` case: documents of 37, 93 and 126 tokens."""


def _layer(generator):
    import torch

    config = attention_config(micro().model.attention)
    layer = config.build(D_MODEL, layer_idx=7, n_layers=micro().model.n_layers)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if name == "ssmax_scale":
                p.copy_(torch.empty_like(p).uniform_(0.25, 0.75, generator=generator))
            elif name.endswith("_norm.weight"):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=generator))
            else:  # linear [out, in]
                p.copy_(torch.randn(p.shape, generator=generator) / p.shape[-1] ** 0.5)
    return config, layer


def export() -> list[GoldenFile]:
    import torch

    generator = torch.Generator().manual_seed(SEED)
    config, layer = _layer(generator)
    x = torch.randn(*X_SHAPE, generator=generator, requires_grad=True)
    tensors = layer_vjp(layer, x, generator)
    with torch.no_grad():
        cu_doc_lens = torch.tensor(DOC_BOUNDS, dtype=torch.int32)
        q, _, _ = layer._prepare_qkv(x[:1], cu_doc_lens=cu_doc_lens)
    tensors["doc.q"] = q
    return [
        GoldenFile(
            path="attention.safetensors",
            tensors=to_numpy(tensors),
            producer="olmo_core.nn.attention.Attention (torch backend); doc.q from its "
            "_prepare_qkv with cu_doc_lens",
            seeds={"torch": SEED},
            config={
                "attention": config.as_dict(json_safe=True),
                "d_model": D_MODEL,
                "x_shape": list(X_SHAPE),
                "doc_bounds": list(DOC_BOUNDS),
                "weights": "linear N(0, 1/fan_in); q_norm, k_norm 1 + N(0, 0.01); "
                "ssmax_scale U(0.25, 0.75)",
            },
            tolerances={
                "forward": FP32_FORWARD.as_dict(),
                "grad": FP32_GRAD.as_dict(),
                "regenerate": REGENERATE_COMPONENT.as_dict(),
            },
            substitutions=[ATTENTION_BACKEND],
        )
    ]
