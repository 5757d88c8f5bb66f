"""Where arrays live on a `jax.sharding.Mesh` with axes ("data", "fsdp", "expert").

Batches [GA, b, T] split their rows over data x fsdp (every device its own rows, as OLMo-core's
data-parallel ranks). Params are fully sharded over fsdp along their first axis the fsdp size
divides (replicated when none does); routed-expert weights [E, ...] split E over "expert" first.
Gradients take the params' shardings (`train_step`'s grad-sharding constraint).
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

AXES = ("data", "fsdp", "expert")
BATCH_AXES = ("data", "fsdp")


def make_mesh(*, data: int, fsdp: int = 1, expert: int = 1) -> Mesh:
    """A mesh of the first data * fsdp * expert devices."""
    n = data * fsdp * expert
    devices = jax.devices()
    if n > len(devices):
        raise ValueError(
            f"mesh data={data} x fsdp={fsdp} x expert={expert} needs {n} devices, "
            f"{len(devices)} exist"
        )
    return Mesh(np.array(devices[:n]).reshape(data, fsdp, expert), AXES)


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Micro-batches [GA, b, ...]: rows b over data x fsdp."""
    return NamedSharding(mesh, P(None, BATCH_AXES))


def _is_routed_expert(path) -> bool:
    return any(getattr(k, "key", getattr(k, "name", None)) == "routed_experts" for k in path)


def param_spec(path, shape: tuple[int, ...], mesh: Mesh) -> P:
    """The partition spec of one param (see the module docstring)."""
    spec: list = [None] * len(shape)
    taken = set()
    if _is_routed_expert(path) and shape and shape[0] % mesh.shape["expert"] == 0:
        spec[0] = "expert"
        taken.add(0)
    fsdp = mesh.shape["fsdp"]
    for axis, size in enumerate(shape):
        if axis not in taken and fsdp > 1 and size % fsdp == 0:
            spec[axis] = "fsdp"
            break
    return P(*spec)


def param_shardings(params, mesh: Mesh):
    """NamedShardings like `params`."""
    return jax.tree_util.tree_map_with_path(
        lambda path, x: NamedSharding(mesh, param_spec(path, x.shape, mesh)), params
    )
