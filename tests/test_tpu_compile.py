"""The Pallas kernels compiled for a TPU by XLA's TPU compiler on this CPU, without a TPU
(deviceless, as bench/tpu_memory.py): megablox's (gmm forward; gmm and tgmm backward) for float32
and bfloat16 operands, KDA's intra-chunk scores (forward and backward) at the slice's chunk and
flash attention (forward and backward) at the slice's heads, each at every
`ScaleConfig.matmul_precision`, and the latter two inside `shard_map` on a mesh, as the model runs
them there. Pallas's interpreter, which the other tests run
the kernels in, accepts kernels that Mosaic refuses (a float32 contract precision on bfloat16
tiles). Needs libtpu: `tox -e tpu-aot` runs these (CI's tpu-aot stage); elsewhere they skip,
saying so."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from model.attention import causal_attention_for
from model.attention_pallas import FLASH_BLOCK, pallas_causal_attention
from model.config import MATMUL_PRECISIONS, olmo35_slice
from model.kda import intra_chunk_scores_for
from model.kda_pallas import pallas_intra_chunk_scores
from model.layout import Layout, make_mesh
from model.moe import MEGABLOX_TILE, megablox_matmul

pytest.importorskip("libtpu", reason="no libtpu: the TPU compiler runs under `tox -e tpu-aot`")
from parity.tpu_topology import tpu_devices

pytestmark = pytest.mark.tpu_aot

TOPOLOGY = "v4:2x2x1"
ROWS, LATENT, HIDDEN, EXPERTS = 2 * MEGABLOX_TILE, MEGABLOX_TILE, 2 * MEGABLOX_TILE, 8


def _one_device():
    device = tpu_devices(TOPOLOGY)[0]
    return NamedSharding(Mesh(np.array([device]), ("x",)), PartitionSpec())


@pytest.mark.parametrize("precision", MATMUL_PRECISIONS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_megablox_compiles_for_tpu(dtype, precision):
    one_device = _one_device()

    def grads(x, w, group_sizes):
        def objective(x, w):
            return jnp.sum(megablox_matmul(x, w, group_sizes).astype(jnp.float32) ** 2)

        return jax.grad(objective, argnums=(0, 1))(x, w)

    shapes = [((ROWS, LATENT), dtype), ((EXPERTS, LATENT, HIDDEN), dtype), ((EXPERTS,), "int32")]
    args = [jax.ShapeDtypeStruct(s, jnp.dtype(d), sharding=one_device) for s, d in shapes]
    with jax.default_matmul_precision(precision):
        compiled = jax.jit(grads).trace(*args).lower().compile()
    assert "tpu_custom_call" in compiled.as_text()


@pytest.mark.parametrize("precision", MATMUL_PRECISIONS)
def test_kda_intra_chunk_kernel_compiles_for_tpu(precision):
    kda = olmo35_slice().model.kda
    chunks = jax.ShapeDtypeStruct(
        (16, kda.chunk_size, kda.head_dim), jnp.float32, sharding=_one_device()
    )

    def grads(q, k, g):
        def objective(q, k, g):
            s_qk, s_kk = pallas_intra_chunk_scores(q, k, g)
            return jnp.sum(s_qk * s_kk)

        return jax.grad(objective, argnums=(0, 1, 2))(q, k, g)

    with jax.default_matmul_precision(precision):
        compiled = jax.jit(grads).trace(chunks, chunks, chunks).lower().compile()
    assert compiled.as_text().count("tpu_custom_call") >= 2  # forward and backward


def test_kda_intra_chunk_kernel_compiles_on_a_mesh():
    """On a mesh of 4 chips the model runs the kernel on each one's rows (`shard_map`): XLA does
    not partition Mosaic kernels, and fails to compile one given split operands."""
    kda = olmo35_slice().model.kda
    layout = Layout(make_mesh(data=2, fsdp=2, devices=tpu_devices(TOPOLOGY)))
    scores = intra_chunk_scores_for("pallas", kda, layout)
    assert scores is not pallas_intra_chunk_scores
    shape = (8, kda.n_heads, 2, kda.chunk_size, kda.head_dim)  # [B, H, N, C, K]
    rows = NamedSharding(layout.mesh, PartitionSpec(("data", "fsdp")))
    chunks = jax.ShapeDtypeStruct(shape, jnp.float32, sharding=rows)

    def grads(q, k, g):
        return jax.grad(lambda *a: jnp.sum(scores(*a)[0] ** 2), argnums=(0, 1, 2))(q, k, g)

    compiled = jax.jit(grads).trace(chunks, chunks, chunks).lower().compile()
    assert compiled.as_text().count("tpu_custom_call") >= 2


def _attention_grads(attend):
    def grads(q, k, v, segment_ids):
        def objective(q, k, v):
            return jnp.sum(attend(q, k, v, segment_ids=segment_ids) ** 2)

        return jax.grad(objective, argnums=(0, 1, 2))(q, k, v)

    return grads


def _attention_inputs(rows: int, sharding):
    """q, k, v and segment ids of `rows` rows of two flash blocks at the slice's heads."""
    a = olmo35_slice().model.attention
    T = 2 * FLASH_BLOCK
    shapes = [(rows, T, a.n_heads, a.head_dim), *[(rows, T, a.n_kv_heads, a.head_dim)] * 2]
    tensors = [jax.ShapeDtypeStruct(s, jnp.float32, sharding=sharding) for s in shapes]
    return *tensors, jax.ShapeDtypeStruct((rows, T), jnp.int32, sharding=sharding)


@pytest.mark.parametrize("precision", MATMUL_PRECISIONS)
def test_flash_attention_compiles_for_tpu(precision):
    grads = _attention_grads(pallas_causal_attention)
    with jax.default_matmul_precision(precision):
        compiled = jax.jit(grads).trace(*_attention_inputs(2, _one_device())).lower().compile()
    assert compiled.as_text().count("tpu_custom_call") >= 2  # forward and backward


def test_flash_attention_compiles_on_a_mesh():
    a = olmo35_slice().model.attention
    layout = Layout(make_mesh(data=2, fsdp=2, devices=tpu_devices(TOPOLOGY)))
    attend = causal_attention_for("pallas", a, 2 * FLASH_BLOCK, layout)
    assert attend is not pallas_causal_attention
    rows = NamedSharding(layout.mesh, PartitionSpec(("data", "fsdp")))
    compiled = (
        jax.jit(_attention_grads(attend)).trace(*_attention_inputs(8, rows)).lower().compile()
    )
    assert compiled.as_text().count("tpu_custom_call") >= 2
