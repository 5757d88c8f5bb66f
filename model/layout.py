"""Where arrays live on a `jax.sharding.Mesh` with axes ("data", "fsdp", "expert"): the mesh, the
logical axis names of params and activations, and the shardings they give.

Every param carries logical axis names, its `logical_axes` metadata, set where its module makes it
(`model.init.linear`, `model.norms.RMSNorm`, ...); large activations get theirs where they are
made. `ScaleConfig.logical_axis_rules` maps each name to mesh axes, as MaxText's
`logical_axis_rules`, and `Layout.spec` turns a shape's names into a `PartitionSpec`.

The model runs under `jax.jit` (GSPMD): rows split over data x fsdp x expert, every weight split
over fsdp and gathered by XLA where a layer uses it, its gradient reduce-scattered back; routed
experts split over "expert" and run inside `shard_map` (`model.expert_parallel`). `model.state`
builds the model, its train state and its compiled step on a layout.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from model.config import LOGICAL_AXIS_RULES, MESH_AXES, Config

Logical = tuple[str | None, ...]
"""One logical axis name (or None: never split) per dimension."""


def make_mesh(*, data: int = 1, fsdp: int = 1, expert: int = 1, devices=None) -> Mesh:
    """A mesh of the first data * fsdp * expert of `devices` (None: `jax.devices()`; or, say, a
    TPU topology's compile-only devices)."""
    sizes = {"data": data, "fsdp": fsdp, "expert": expert}
    bad = {name: size for name, size in sizes.items() if size < 1}
    if bad:
        raise ValueError(f"mesh axes must be >= 1, got {bad}")
    n = data * fsdp * expert
    devices = jax.devices() if devices is None else list(devices)
    if n > len(devices):
        raise ValueError(
            f"mesh data={data} x fsdp={fsdp} x expert={expert} needs {n} devices, "
            f"{len(devices)} exist"
        )
    return Mesh(np.array(devices[:n]).reshape(data, fsdp, expert), MESH_AXES)


@dataclasses.dataclass(frozen=True)
class Layout:
    """A mesh and the logical axis rules (`ScaleConfig.logical_axis_rules`)."""

    mesh: Mesh
    rules: tuple[tuple[str, tuple[str, ...]], ...] = LOGICAL_AXIS_RULES

    def spec(self, logical: Logical, shape: tuple[int, ...]) -> P:
        """Each dimension in order takes the mesh axes of its name's rule that no earlier
        dimension took, that have more than one device, and that keep it evenly divided."""
        if len(logical) != len(shape):
            raise ValueError(f"logical axes {logical} for a shape {shape}")
        rules, used, spec = dict(self.rules), set(), []
        for name, size in zip(logical, shape, strict=True):
            if name is not None and name not in rules:
                raise ValueError(f"logical axis {name!r} has no rule in {sorted(rules)}")
            taken, shards = [], 1
            for axis in rules.get(name, ()):
                n = self.mesh.shape[axis]
                if axis not in used and n > 1 and size % (shards * n) == 0:
                    taken.append(axis)
                    shards *= n
            used.update(taken)
            spec.append(tuple(taken) if len(taken) > 1 else (taken[0] if taken else None))
        return P(*spec)

    @property
    def platform(self) -> str:
        """The mesh's devices' platform ("cpu", "tpu", ...): what the model compiles for, which
        under ahead-of-time compilation need not be JAX's default backend."""
        return self.mesh.devices.flat[0].platform

    def sharding(self, logical: Logical, shape: tuple[int, ...]) -> NamedSharding:
        return NamedSharding(self.mesh, self.spec(logical, shape))

    def constrain(self, x: jax.Array, logical: Logical) -> jax.Array:
        """`x` laid out as its logical axes say (a GSPMD sharding constraint)."""
        return jax.lax.with_sharding_constraint(x, self.sharding(logical, x.shape))

    def batch_axes(self, rows: int) -> tuple[str, ...]:
        """The mesh axes `rows` rows are split over."""
        axes = self.spec(("batch",), (rows,))[0]
        return () if axes is None else (axes,) if isinstance(axes, str) else axes

    def batch_shards(self, rows: int) -> int:
        """How many devices hold different rows."""
        return math.prod(self.mesh.shape[axis] for axis in self.batch_axes(rows))

    def per_rows(self, kernel, *arrays):
        """`kernel(*arrays)`, every array and result [rows, ...], inside `shard_map` over the
        batch axes: XLA does not partition a Mosaic kernel ("Mosaic kernels cannot be
        automatically partitioned"), so each device runs it on its own rows."""
        rows = P(self.batch_axes(arrays[0].shape[0]) or None)
        return jax.shard_map(
            kernel,
            mesh=self.mesh,
            in_specs=(rows,) * len(arrays),
            out_specs=rows,
            check_vma=False,  # a Pallas kernel declares no varying axes
        )(*arrays)

    def micro_batch_sharding(self, rows: int) -> NamedSharding:
        """Micro-batches [GA, rows, ...]: rows over the batch axes."""
        return NamedSharding(self.mesh, P(None, self.batch_axes(rows) or None))


def layout_of(cfg: Config, mesh: Mesh) -> Layout:
    """`mesh` with `cfg`'s logical axis rules."""
    return Layout(mesh, cfg.scale.logical_axis_rules)


def _is_variable(x) -> bool:
    return isinstance(x, nnx.Variable)


def logical_axes(variable: nnx.Variable) -> Logical:
    """A param's logical axis names (its `logical_axes` metadata)."""
    axes = variable.get_metadata().get("logical_axes")
    if axes is None:
        raise ValueError(f"a param of shape {variable.shape} has no logical_axes metadata")
    return axes


def param_shardings(params: nnx.State, layout: Layout) -> nnx.State:
    """NamedShardings in the structure of `params` (arrays or abstract), from their logical axes."""
    return jax.tree.map(
        lambda v: v.replace(layout.sharding(logical_axes(v), v.shape)), params, is_leaf=_is_variable
    )


def with_shardings(tree, shardings):
    """`jax.ShapeDtypeStruct`s of `tree`'s leaves carrying `shardings` (a pytree like it)."""
    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings
    )
