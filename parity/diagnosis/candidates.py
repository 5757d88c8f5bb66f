"""The candidates of the diagnosis: OLMo-core's run itself, then each MaxText behaviour alone, as
a `parity.run.Run` (a config change, a device count, or a variant of `parity.diagnosis.variants`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from model.config import Config
from parity.diagnosis import variants
from parity.run import MeshShape, Run

DEVICES = 4
"""Data devices of the per-device load-balancing candidate (one row of a micro-batch each)."""


@dataclass(frozen=True)
class Candidate:
    name: str
    what: str
    """The MaxText behaviour, and where it lives."""
    run: Run


def _flags(config: Config, **changes) -> Config:
    return dataclasses.replace(config, flags=dataclasses.replace(config.flags, **changes))


def _moe(config: Config, **changes) -> Config:
    moe = dataclasses.replace(config.model.moe, **changes)
    return dataclasses.replace(config, model=dataclasses.replace(config.model, moe=moe))


def candidates(config: Config) -> list[Candidate]:
    """The OLMo-core run itself, then each MaxText behaviour alone, from `config` (OLMo-core's)."""
    jax_draws = variants.JaxDraws(config.model.moe.emo)
    bf16_router = _moe(config, router_dtype="bfloat16")
    each = [
        ("olmo_core", "every behaviour OLMo-core's (the floor: fp32 drift only)", Run(config)),
        (
            "aux_mean",
            "MoE aux losses averaged over layers, not summed (`moe_aux_loss_reduction`)",
            Run(_flags(config, moe_aux_loss_reduction="mean")),
        ),
        (
            "lb_per_device",
            f"load balancing on each of {DEVICES} devices' own counts, device 0's value logged "
            "(`moe_global_load_balancing` off)",
            Run(_flags(config, moe_global_load_balancing=False), mesh=MeshShape(data=DEVICES)),
        ),
        (
            "ga_logs",
            "z-loss and aux losses logged as the sum of micro-batch means: GA times too large "
            "(`variants.micro_batch_mean_logs`)",
            Run(config, wrap_terms=variants.micro_batch_mean_logs),
        ),
        (
            "lb_div_micro_batch",
            "router losses divided by the micro-batch's labelled tokens, not the batch's "
            "(`variants.aux_per_micro_batch_labels`)",
            Run(config, wrap_terms=variants.aux_per_micro_batch_labels),
        ),
        (
            "lb_div_positions",
            "router losses divided by the micro-batch's positions, ignored labels included "
            "(`variants.aux_per_micro_batch_positions`)",
            Run(config, wrap_terms=variants.aux_per_micro_batch_positions),
        ),
        (
            "warmup_from_0",
            "LR warmup counted from step 0, not 1 (`warmup_step_offset`)",
            Run(_flags(config, warmup_step_offset=0)),
        ),
        (
            "jax_draws",
            "EMO pool sizes drawn by JAX's RNG: same distribution, other values "
            "(`variants.JaxDraws`)",
            Run(config, draws=jax_draws),
        ),
        (
            "router_bf16",
            "router logits computed in bfloat16 (`MoEConfig.router_dtype`)",
            Run(bf16_router),
        ),
        (
            "no_weight_norm",
            "selected expert weights not L1-normalised, nor scaled by top_k "
            "(`MoEConfig.normalize_expert_weights`)",
            Run(_moe(config, normalize_expert_weights=False, restore_weight_scale=False)),
        ),
        (
            "no_scale_restore",
            "selected weights normalised but not scaled back by top_k "
            "(`MoEConfig.restore_weight_scale`)",
            Run(_moe(config, restore_weight_scale=False)),
        ),
        (
            "segments_per_row",
            "EMO pools per row, documents not split at EOS (`olmo_segment_ids_from_eos` off)",
            Run(_flags(config, olmo_segment_ids_from_eos=None)),
        ),
        (
            "mixers_per_document",
            "KDA and attention restarted at every document (`olmoe3_mixers_ignore_segment_ids` "
            "off)",
            Run(_flags(config, olmoe3_mixers_ignore_segment_ids=False)),
        ),
        (
            "jax_draws+router_bf16",
            "the two behaviours the seed's flags leave as MaxText's: its own EMO draws (it cannot "
            "replay torch's RNG) and router logits in its bf16 activation dtype",
            Run(bf16_router, draws=jax_draws),
        ),
    ]
    return [Candidate(name, what, run) for name, what, run in each]
