"""The TPU's float32 transcendentals as configuration: libtpu's flags, set in LIBTPU_INIT_ARGS
before the TPU backend starts (it reads them once).

By default the chip's exp, log and the ops built on them (log1p, expm1, pow, logistic) are fast
and loose: on a TPU v5 lite, 2^20 float32 inputs against float64 gave max errors of 70 ulps
(exp) to 4,000 (log, log1p); with libtpu's accurate flags 1 to 3 ulps, a CPU's (tanh, 1,360
ulps, has no such flag). Lockstep needs them: optax's Adam bias correction 1 - 0.95^t (a pow) is
1.7e-5 off at the default, 4e-7 with the flags, and the optimizer alone is held to 1e-5
(`LockstepBounds.optimizer`).
"""

from __future__ import annotations

import os

TRANSCENDENTALS = ("accurate", "default")
ACCURATE_OPS = ("exp", "exp2", "expm1", "log1p", "log2", "logistic")
"""Ops with an `--xla_tpu_accurate_<op>` flag in libtpu 0.0.42.1 (jax 0.10.2's)."""


def libtpu_flags(transcendentals: str) -> list[str]:
    """The flags that pin every op of ACCURATE_OPS to `transcendentals`'s implementation."""
    if transcendentals not in TRANSCENDENTALS:
        raise ValueError(
            f"transcendentals must be one of {TRANSCENDENTALS}, got {transcendentals!r}"
        )
    value = str(transcendentals == "accurate").lower()
    return [f"--xla_tpu_accurate_{op}={value}" for op in ACCURATE_OPS]


def use_transcendentals(transcendentals: str) -> None:
    """LIBTPU_INIT_ARGS with `libtpu_flags(transcendentals)` in place of any accurate-op flags
    it held; call before JAX starts its TPU backend."""
    given = os.environ.get("LIBTPU_INIT_ARGS", "").split()
    kept = [flag for flag in given if not flag.startswith("--xla_tpu_accurate_")]
    os.environ["LIBTPU_INIT_ARGS"] = " ".join([*kept, *libtpu_flags(transcendentals)])
