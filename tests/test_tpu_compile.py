"""megablox's Pallas kernels (gmm forward; gmm and tgmm backward) compiled for a TPU by XLA's TPU
compiler on this CPU, without a TPU (deviceless, as bench/tpu_memory.py): float32 and bfloat16
operands at every `ScaleConfig.matmul_precision`. Pallas's interpreter, which the other tests run
the kernels in, accepts kernels that Mosaic refuses (a float32 contract precision on bfloat16
tiles). Needs libtpu: `tox -e tpu-aot` runs these (CI's tpu-aot stage); elsewhere they skip,
saying so."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from model.config import MATMUL_PRECISIONS
from model.moe import MEGABLOX_TILE, megablox_matmul

pytest.importorskip("libtpu", reason="no libtpu: the TPU compiler runs under `tox -e tpu-aot`")
from parity.tpu_topology import tpu_devices

pytestmark = pytest.mark.tpu_aot

TOPOLOGY = "v4:2x2x1"
ROWS, LATENT, HIDDEN, EXPERTS = 2 * MEGABLOX_TILE, MEGABLOX_TILE, 2 * MEGABLOX_TILE, 8


@pytest.mark.parametrize("precision", MATMUL_PRECISIONS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_megablox_compiles_for_tpu(dtype, precision):
    device = tpu_devices(TOPOLOGY)[0]
    one_device = NamedSharding(Mesh(np.array([device]), ("x",)), PartitionSpec())

    def grads(x, w, group_sizes):
        def objective(x, w):
            return jnp.sum(megablox_matmul(x, w, group_sizes).astype(jnp.float32) ** 2)

        return jax.grad(objective, argnums=(0, 1))(x, w)

    shapes = [((ROWS, LATENT), dtype), ((EXPERTS, LATENT, HIDDEN), dtype), ((EXPERTS,), "int32")]
    args = [jax.ShapeDtypeStruct(s, jnp.dtype(d), sharding=one_device) for s, d in shapes]
    with jax.default_matmul_precision(precision):
        compiled = jax.jit(grads).trace(*args).lower().compile()
    assert "tpu_custom_call" in compiled.as_text()
