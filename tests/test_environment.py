"""The conftest set-up every other test relies on."""

import jax


def test_eight_simulated_cpu_devices():
    assert jax.device_count() == 8
    assert {d.platform for d in jax.devices()} == {"cpu"}


def test_matmul_precision_is_highest():
    assert jax.config.jax_default_matmul_precision == "highest"
