"""RMSNorm forward + backward at the hero's activation shape [1, 8192, 1024], fp32 on CPU:
`model.norms.rms_norm` under jax.jit against OLMo-core's `RMSNorm` in eager torch."""

import jax
import jax.numpy as jnp
import numpy as np

from bench.timing import best_seconds
from model.norms import rms_norm

SHAPE = (1, 8192, 1024)
EPS = 1e-6


def run() -> dict[str, float]:
    import torch
    from olmo_core.nn.layer_norm import LayerNormConfig, LayerNormType

    rng = np.random.default_rng(0)
    x, cotangent = (rng.standard_normal(SHAPE, dtype=np.float32) for _ in range(2))
    weight = np.ones(SHAPE[-1], np.float32)

    @jax.jit
    def jax_step(x, weight, cotangent):
        y, vjp = jax.vjp(lambda x, w: rms_norm(x, w, eps=EPS), x, weight)
        return y, vjp(cotangent)

    args = tuple(jnp.asarray(a) for a in (x, weight, cotangent))
    jax_s = best_seconds(lambda: jax.block_until_ready(jax_step(*args)))

    norm = LayerNormConfig(name=LayerNormType.rms, eps=EPS, bias=False).build(SHAPE[-1])
    tx, tc = torch.from_numpy(x).requires_grad_(True), torch.from_numpy(cotangent)

    def torch_step():
        tx.grad = norm.weight.grad = None
        (norm(tx) * tc).sum().backward()

    torch_s = best_seconds(torch_step)
    return {
        "jax fwd+bwd (ms)": 1e3 * jax_s,
        "olmo-core fwd+bwd (ms)": 1e3 * torch_s,
        "jax / olmo-core time": jax_s / torch_s,
    }
