"""Causal attention cases for the flash kernel's tests, on the CPU (tests/test_attention_pallas.py)
and on the chip (tests/test_tpu.py): inputs, values and gradients, the float64 oracle."""

import jax
import jax.numpy as jnp
import numpy as np

from model.attention import causal_attention

B, T, H, HKV, D = 2, 256, 4, 2, 128
"""Two rows of two 128-token blocks, two query heads a KV head, the kernel's head width."""
DOCUMENTS = np.array([[0] * 100 + [1] * 80 + [2] * 76, [0] * 256])
"""Row 0: three documents whose boundaries cut through the kernel's blocks; row 1: one."""


def attention_inputs(seed: int = 0) -> list[np.ndarray]:
    """q [B, T, H, D] (twice the unit scale, so the softmax is peaked), k, v [B, T, HKV, D] and an
    output cotangent, float64."""
    rng = np.random.default_rng(seed)
    shapes = [(B, T, H, D), (B, T, HKV, D), (B, T, HKV, D), (B, T, H, D)]
    return [rng.standard_normal(s) * (2.0 if i == 0 else 1.0) for i, s in enumerate(shapes)]


def attention_case(documents: bool) -> tuple[list[np.ndarray], np.ndarray | None]:
    """(`attention_inputs()`, DOCUMENTS or None for whole rows)."""
    return attention_inputs(), DOCUMENTS if documents else None


def float32_case(inputs, segments) -> tuple[list[jax.Array], jax.Array | None]:
    """A case's inputs in float32 and its segment ids in int32 (None: whole rows), on JAX's
    default device."""
    ids = None if segments is None else jnp.asarray(segments, jnp.int32)
    return [jnp.asarray(x, jnp.float32) for x in inputs], ids


def value_and_grads(attend, q, k, v, cotangent, segment_ids):
    """(output, dq, dk, dv) of `attend(q, k, v, segment_ids=...)` for `cotangent`."""
    out, vjp = jax.vjp(lambda q, k, v: attend(q, k, v, segment_ids=segment_ids), q, k, v)
    return (out, *vjp(cotangent))


def float64_attention(q, k, v, cotangent, segment_ids) -> list[np.ndarray]:
    """`value_and_grads` of `causal_attention` in float64, on JAX's default device."""
    with jax.enable_x64(True):
        args = [jnp.asarray(x, jnp.float64) for x in (q, k, v, cotangent)]
        segments = None if segment_ids is None else jnp.asarray(segment_ids)
        return [np.asarray(x) for x in value_and_grads(causal_attention, *args, segments)]


def attention_error(expected, actual) -> float:
    """The largest of each tensor's largest error over its largest element (out, dq, dk, dv)."""
    return max(
        float(np.max(np.abs(e - np.asarray(a, np.float64))) / np.max(np.abs(e)))
        for e, a in zip(expected, actual, strict=True)
    )
