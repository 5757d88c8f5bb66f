"""A TPU topology's devices without a TPU, for deviceless ahead-of-time compilation on a CPU by
XLA's TPU compiler (libtpu; `tox -e tpu-aot`), as MaxText's `train_compile.py` does."""

from __future__ import annotations

from jax.experimental import topologies


def tpu_devices(topology: str) -> list:
    """The devices of TPU `topology` ("v4:2x2x1", ...), megacore chips in hosts of 2x2x1, one
    slice, every axis wrapped."""
    return topologies.get_topology_desc(
        platform="tpu",
        topology_name=topology,
        chip_config_name="megacore",
        chips_per_host_bounds=(2, 2, 1),
        num_slices=1,
        wrap=(True, True, True),
    ).devices
