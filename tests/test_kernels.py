"""The kernels a step runs, as records name them (model/kernels.py): the TPU's Pallas kernels only
where the widths fit them, so the micro config runs XLA's ops on a TPU as on any backend."""

import dataclasses

from model.config import micro, olmo35_slice
from model.kernels import StepKernels, step_kernels


def test_the_slice_runs_the_pallas_kernels_on_a_tpu():
    cfg = olmo35_slice()
    assert step_kernels(cfg, "tpu") == StepKernels("megablox", "pallas", "pallas")
    assert step_kernels(cfg, "cpu") == StepKernels("tiles", "xla", "xla")
    assert step_kernels(cfg, "gpu") == StepKernels("ragged_dot", "xla", "xla")
    for field, kernels in [
        ("kda_kernel", StepKernels("megablox", "xla", "pallas")),
        ("attention_kernel", StepKernels("megablox", "pallas", "xla")),
    ]:
        xla = dataclasses.replace(cfg, scale=dataclasses.replace(cfg.scale, **{field: "xla"}))
        assert step_kernels(xla, "tpu") == kernels, field


def test_flash_attention_needs_whole_blocks_of_the_sequence():
    cfg = olmo35_slice()
    odd = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, seq_len=4096 + 128))
    assert step_kernels(odd, "tpu").attention == "xla"


def test_the_micro_config_is_below_the_tpu_kernels_widths():
    assert step_kernels(micro(), "tpu") == StepKernels("ragged_dot", "xla", "xla")


def test_a_model_without_kda_or_attention_names_none():
    cfg = micro()
    for mixer, kernels in [
        ("attention", StepKernels("ragged_dot", None, "xla")),
        ("kda", StepKernels("ragged_dot", "xla", None)),
    ]:
        model = dataclasses.replace(cfg.model, layer_types=(mixer,) * cfg.model.n_layers)
        assert step_kernels(dataclasses.replace(cfg, model=model), "tpu") == kernels
