"""Goldens of OLMo-core's `RMSNorm` (olmo_core/nn/layer_norm.py), fp32: one norm over d_model and
one per-head norm with (H, D) gains (`weight_shape`, as attention's QK norm). Inputs include a
near-zero row so that eps matters. Gradients are of sum(y * cotangent)."""

from goldens.store import GoldenFile
from goldens.tolerances import FP32_FORWARD, FP32_GRAD, REGENERATE_COMPONENT

SEED = 1001
EPS = 1e-6
CASES = {
    "d_model": {"size": 64, "weight_shape": [64], "x_shape": [2, 16, 64]},
    "per_head": {"size": 32, "weight_shape": [2, 32], "x_shape": [2, 16, 2, 32]},
}


def export() -> list[GoldenFile]:
    import torch
    from olmo_core.nn.layer_norm import LayerNormConfig, LayerNormType

    generator = torch.Generator().manual_seed(SEED)
    config = LayerNormConfig(name=LayerNormType.rms, eps=EPS, bias=False)
    tensors = {}
    for case, spec in CASES.items():
        norm = config.build(spec["size"], weight_shape=tuple(spec["weight_shape"]))
        with torch.no_grad():
            norm.weight.copy_(1 + 0.1 * torch.randn(spec["weight_shape"], generator=generator))
        x = torch.randn(spec["x_shape"], generator=generator)
        x[0, 0] *= 1e-3  # mean(x^2) ~ 1e-6, the size of eps
        x.requires_grad_(True)
        y = norm(x)
        cotangent = torch.randn(spec["x_shape"], generator=generator)
        (y * cotangent).sum().backward()
        for name, value in {
            "x": x,
            "weight": norm.weight,
            "y": y,
            "cotangent": cotangent,
            "dx": x.grad,
            "dweight": norm.weight.grad,
        }.items():
            tensors[f"{case}.{name}"] = value.detach().numpy().copy()
    return [
        GoldenFile(
            path="rms_norm.safetensors",
            tensors=tensors,
            producer="olmo_core.nn.layer_norm.RMSNorm",
            seeds={"torch": SEED},
            config={"eps": EPS, "cases": CASES},
            tolerances={
                "forward": FP32_FORWARD.as_dict(),
                "grad": FP32_GRAD.as_dict(),
                "regenerate": REGENERATE_COMPONENT.as_dict(),
            },
        )
    ]
