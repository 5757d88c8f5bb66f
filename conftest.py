"""Test set-up for every pytest process (xdist workers too): 8 simulated CPU devices and float32
matmuls at "highest" precision, both fixed before JAX is imported; a persistent compilation
cache; golden fixtures through the golden store, so a missing or stale golden fails naming the
file and how to regenerate it."""

import getpass
import os
import re
import tempfile

# Before anything imports jax: XLA reads these once, at backend start.
_flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "", os.environ.get("XLA_FLAGS", ""))
os.environ["XLA_FLAGS"] = f"{_flags} --xla_force_host_platform_device_count=8".strip()
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402

from goldens.store import Golden, GoldenError, load_golden  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

# Compiled executables persist in this machine's temp folder (unless JAX_COMPILATION_CACHE_DIR
# says otherwise): xdist workers reuse each other's compiles, and later runs (`tox -e slow` after
# the gate) the gate's. Keyed by XLA on the program, flags and versions, so a change recompiles.
if not jax.config.jax_compilation_cache_dir:
    cache = os.path.join(tempfile.gettempdir(), f"olmo-parity-jax-cache-{getpass.getuser()}")
    jax.config.update("jax_compilation_cache_dir", cache)

# XLA compilation dominates a JAX example: no deadline; fixed derandomised examples in the gate.
settings.register_profile("gate", deadline=None, derandomize=True, print_blob=True)
settings.load_profile("gate")


def pytest_collection_modifyitems(items):
    """Tests marked `longest` first (stable otherwise): xdist hands out modules in this order."""
    items.sort(key=lambda item: item.get_closest_marker("longest") is None)


@pytest.fixture(scope="session")
def golden():
    """`golden("<path in goldens/>")` -> verified `Golden`; fails the test if missing or stale."""
    cache: dict[str, Golden] = {}

    def load(path: str) -> Golden:
        if path not in cache:
            try:
                cache[path] = load_golden(path)
            except GoldenError as error:
                pytest.fail(str(error), pytrace=False)
        return cache[path]

    return load
