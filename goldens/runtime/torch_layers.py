"""What the layer exporters share: a cotangent at token-mean scale, one layer's output and
gradients as named tensors, and torch tensors as the numpy arrays a `GoldenFile` holds."""

from __future__ import annotations


def token_mean_cotangent(shape, generator):
    """N(0, 1 / (B*T)) of `shape` [B, T, ...]: the weight gradients, sums over B*T tokens, come out
    O(1), as in a token-mean loss."""
    import torch

    return torch.randn(shape, generator=generator) / (shape[0] * shape[1]) ** 0.5


def layer_vjp(layer, x, generator) -> dict:
    """x (a leaf that requires grad), y = layer(x), a token-mean cotangent from `generator` and the
    gradients of sum(y * cotangent): {"x", "y", "cotangent", "grad.x", "param.<name>",
    "grad.<name>"} with OLMo-core's parameter names."""
    y = layer(x)
    cotangent = token_mean_cotangent(y.shape, generator)
    (y * cotangent).sum().backward()
    tensors = {"x": x, "y": y, "cotangent": cotangent, "grad.x": x.grad}
    for name, p in layer.named_parameters():
        tensors[f"param.{name}"] = p
        tensors[f"grad.{name}"] = p.grad
    return tensors


def to_numpy(tensors: dict) -> dict:
    """Torch tensors -> detached numpy copies."""
    return {k: v.detach().numpy().copy() for k, v in tensors.items()}
