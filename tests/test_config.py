"""Configs: presets and flag defaults as snapshots, named errors on bad input, parameter counts
against OLMo-core 3.0.0's own `num_params` (shared/notes/olmo35_hero.md, micro_hero_on_cpu.md)."""

import dataclasses

import pytest
from syrupy.extensions.json import JSONSnapshotExtension

from model import config as c


@pytest.fixture
def snapshot_json(snapshot):
    return snapshot.use_extension(JSONSnapshotExtension)


@pytest.mark.parametrize("preset", [c.olmo35_tiny, c.micro], ids=lambda p: p.__name__)
def test_preset_snapshot(snapshot_json, preset):
    assert preset().as_dict() == snapshot_json


def test_flag_defaults_are_maxtext_snapshot(snapshot_json):
    assert c.Flags().as_dict() == snapshot_json


def test_olmo_core_flags_snapshot(snapshot_json):
    assert c.olmo_core(
        c.micro(), global_indices_path="goldens/data/indices.npy"
    ).flags.as_dict() == (snapshot_json)


def test_olmo_core_changes_every_parity_flag():
    """Every flag but the memory-only loop barrier and the KDA inverse (a fix, not an option)."""
    default, olmo = c.Flags(), c.olmo_core(c.micro(), global_indices_path="x").flags
    changed = {
        f.name
        for f in dataclasses.fields(c.Flags)
        if getattr(default, f.name) != getattr(olmo, f.name)
    }
    assert changed == {f.name for f in dataclasses.fields(c.Flags)} - {
        "ga_params_loop_barrier",
        "kda_inverse",
    }
    assert olmo.olmo_segment_ids_from_eos == c.micro().model.eos_token_id


@pytest.mark.parametrize(
    ("preset", "total", "active"),
    [(c.olmo35_tiny, 12_496_341_632, 794_233_472), (c.micro, 1_301_360, 699_248)],
    ids=["olmo35_tiny", "micro"],
)
def test_num_params_match_olmo_core(preset, total, active):
    model = preset().model
    assert (model.num_params(), model.num_active_params()) == (total, active)


def test_hero_mixer_counts_match_olmo_core():
    model = c.olmo35_tiny().model
    assert model.kda.num_params(1024) == 7_630_088
    assert model.attention.num_params(1024) == 4_195_848
    assert [i for i, t in enumerate(model.layer_types) if t == "attention"] == [7, 15]


def test_micro_fits_kda_chunks_and_emo():
    cfg = c.micro()
    assert cfg.train.seq_len // cfg.model.kda.chunk_size >= 4
    assert cfg.train.seq_len % cfg.model.kda.chunk_size == 0
    assert cfg.model.moe.emo.min_pool >= cfg.model.moe.top_k


def _micro_model(**changes):
    return dataclasses.replace(c.micro().model, **changes)


BAD = [
    pytest.param(lambda: _micro_model(d_model=0), "ModelConfig.d_model", id="d_model"),
    pytest.param(lambda: _micro_model(eos_token_id=384), "ModelConfig.eos_token_id", id="eos"),
    pytest.param(
        lambda: _micro_model(layer_types=("kda",) * 7),
        "ModelConfig.layer_types",
        id="pattern-length",
    ),
    pytest.param(
        lambda: _micro_model(layer_types=("kda",) * 7 + ("mamba",)),
        "ModelConfig.layer_types",
        id="pattern-kind",
    ),
    pytest.param(
        lambda: _micro_model(dense_layers=(8,)), "ModelConfig.dense_layers", id="dense-range"
    ),
    pytest.param(
        lambda: _micro_model(dense_layers=tuple(range(8))), "ModelConfig.dense_layers", id="no-moe"
    ),
    pytest.param(
        lambda: _micro_model(compute_dtype="float16"), "ModelConfig.compute_dtype", id="dtype"
    ),
    pytest.param(
        lambda: c.KDAConfig(n_heads=2, head_dim=32, expand_v=1.5 + 1 / 64),
        "KDAConfig.expand_v",
        id="expand_v",
    ),
    pytest.param(
        lambda: c.AttentionConfig(n_heads=3, n_kv_heads=2, head_dim=32),
        "AttentionConfig.n_kv_heads",
        id="gqa",
    ),
    pytest.param(
        lambda: c.AttentionConfig(2, 1, 32, positional_encoding="rope"),
        "AttentionConfig.positional_encoding",
        id="rope",
    ),
    pytest.param(lambda: c.MoEConfig(16, 17, 64, 32, None), "MoEConfig.top_k", id="top_k"),
    pytest.param(
        lambda: c.MoEConfig(16, 4, 64, 32, 64, emo=c.EmoConfig(2, 16, 16)),
        "MoEConfig.emo",
        id="emo-min-pool",
    ),
    pytest.param(
        lambda: c.MoEConfig(16, 2, 64, 32, 64, emo=c.EmoConfig(2, 32, 16)),
        "MoEConfig.emo",
        id="emo-max-pool",
    ),
    pytest.param(
        lambda: c.MoEConfig(16, 2, 64, 32, 64, emo=c.EmoConfig(2, 16, 32)),
        "MoEConfig.emo",
        id="emo-eval-pool",
    ),
    pytest.param(lambda: c.EmoConfig(8, 4, 8), "EmoConfig.max_pool", id="emo-order"),
    pytest.param(
        lambda: dataclasses.replace(c.micro().train, ga_steps=3), "TrainConfig.ga_steps", id="ga"
    ),
    pytest.param(
        lambda: dataclasses.replace(c.micro().train, schedule="cos"),
        "TrainConfig.schedule",
        id="schedule",
    ),
    pytest.param(
        lambda: dataclasses.replace(c.micro().train, betas=(0.9, 1.0)),
        "TrainConfig.betas",
        id="betas",
    ),
    pytest.param(
        lambda: dataclasses.replace(c.micro().train, warmup_steps=51),
        "TrainConfig.warmup_steps",
        id="warmup",
    ),
    pytest.param(
        lambda: dataclasses.replace(c.micro().train, lb_loss_weight=-1.0),
        "TrainConfig.lb_loss_weight",
        id="lb",
    ),
    pytest.param(
        lambda: c.Flags(moe_aux_loss_reduction="max"),
        "Flags.moe_aux_loss_reduction",
        id="reduction",
    ),
    pytest.param(lambda: c.Flags(kda_inverse="cholesky"), "Flags.kda_inverse", id="inverse"),
    pytest.param(lambda: c.Flags(warmup_step_offset=-1), "Flags.warmup_step_offset", id="offset"),
    pytest.param(
        lambda: dataclasses.replace(c.micro(), flags=c.Flags(olmo_segment_ids_from_eos=0)),
        "Config.flags",
        id="eos-flag",
    ),
    pytest.param(
        lambda: dataclasses.replace(
            c.micro(), train=dataclasses.replace(c.micro().train, vocab_tiles=5)
        ),
        "Config.train",
        id="vocab-tiles",
    ),
]


@pytest.mark.parametrize(("build", "field"), BAD)
def test_bad_config_raises_naming_the_field(build, field):
    with pytest.raises(ValueError, match=rf"^{field}: "):
        build()


def test_configs_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.micro().model.d_model = 128
