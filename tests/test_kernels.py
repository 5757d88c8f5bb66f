"""The kernels a step runs, as records name them (model/kernels.py): the TPU's Pallas kernels only
where the widths fit them, so the micro config runs XLA's ops on a TPU as on any backend."""

import dataclasses

from model.config import micro, olmo35_slice
from model.kernels import StepKernels, step_kernels


def test_the_slice_runs_the_pallas_kernels_on_a_tpu():
    cfg = olmo35_slice()
    assert step_kernels(cfg, "tpu") == StepKernels("megablox", "pallas")
    assert step_kernels(cfg, "cpu") == StepKernels("tiles", "xla")
    assert step_kernels(cfg, "gpu") == StepKernels("ragged_dot", "xla")
    xla = dataclasses.replace(cfg, scale=dataclasses.replace(cfg.scale, kda_kernel="xla"))
    assert step_kernels(xla, "tpu") == StepKernels("megablox", "xla")


def test_the_micro_config_is_below_the_tpu_kernels_widths():
    assert step_kernels(micro(), "tpu") == StepKernels("ragged_dot", "xla")


def test_a_model_without_kda_names_none():
    cfg = micro()
    attention = dataclasses.replace(cfg.model, layer_types=("attention",) * cfg.model.n_layers)
    kernels = step_kernels(dataclasses.replace(cfg, model=attention), "tpu")
    assert kernels == StepKernels("ragged_dot", None)
