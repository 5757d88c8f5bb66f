"""OLMo-core 3.0.0's own model for any `ModelConfig`: the OLMo-core configs of its parts
(`attention_config`, `kda_config`, `router_config`, `block_config`), `model_config(cfg)` the
`OLMoDDPModelConfig` (blocks `moe_fused_v2`, peri-norm, one named block per layer), `build(cfg)`
the `OLMoDDPModel` on this CPU (stand-ins of `goldens.runtime.standins` installed, float32 through
`OLMoDDPModel._training_dtype`, OLMo-core's "normal" init under `init_seed`).

CPU-only runtime choices, none of which changes a parameter: attention backend "torch" (the
hero's flash_4 falls back to it without a GPU), `use_experimental_kernels=False`, no expert
parallelism. The router losses' weights are not part of `ModelConfig` (they are `TrainConfig`'s),
so they are arguments here, defaulting to the recipe's.
"""

from __future__ import annotations

from model.config import AttentionConfig, EmoConfig, KDAConfig, ModelConfig, MoEConfig, TrainConfig

ATTENTION_BACKEND = (
    "AttentionConfig.backend = 'torch' (SDPA): the hero's flash attention needs a GPU"
)
EXPERIMENTAL_KERNELS_OFF = (
    "KimiDeltaAttentionConfig.use_experimental_kernels = False (kernel_fun's kernels need a GPU)"
)
TRAINING_DTYPE = "OLMoDDPModel._training_dtype = float32 (the hero trains in bfloat16); no autocast"
NO_EXPERT_PARALLELISM = "no expert parallelism: the v2 MoE's no_ep path"
RUNTIME = [ATTENTION_BACKEND, EXPERIMENTAL_KERNELS_OFF, TRAINING_DTYPE, NO_EXPERT_PARALLELISM]
"""What `build` runs OLMo-core with on this CPU besides the stand-ins, for the manifests."""

_TRAIN_DEFAULTS = {
    f: TrainConfig.__dataclass_fields__[f].default
    for f in ("lb_loss_weight", "router_z_loss_weight", "init_seed")
}


def rms_norm_config(eps: float):
    """OLMo-core's RMSNorm config: no bias, eps `eps`."""
    from olmo_core.nn.layer_norm import LayerNormConfig, LayerNormType

    return LayerNormConfig(name=LayerNormType.rms, eps=eps, bias=False)


def attention_config(ours: AttentionConfig):
    """The hero's gated NoPE attention (OLMo-core `AttentionConfig`) for `ours`."""
    from olmo_core.nn.attention import (
        AttentionBackendName,
        AttentionConfig,
        AttentionType,
        GateConfig,
        GateGranularity,
    )

    return AttentionConfig(
        name=AttentionType.default,
        n_heads=ours.n_heads,
        n_kv_heads=ours.n_kv_heads,
        head_dim=ours.head_dim,
        bias=False,
        rope=None,
        qk_norm=rms_norm_config(ours.qk_norm_eps),
        use_head_qk_norm=True,
        qk_norm_per_head_gains=True,
        scalable_softmax=True,
        gate=GateConfig(granularity=GateGranularity.elementwise, full_precision=True),
        backend=AttentionBackendName.torch,
    )


def kda_config(ours: KDAConfig):
    """OLMo-core `KimiDeltaAttentionConfig` for `ours` (conv without bias)."""
    from olmo_core.nn.attention import KimiDeltaAttentionConfig

    return KimiDeltaAttentionConfig(
        n_heads=ours.n_heads,
        n_v_heads=ours.n_heads,
        head_dim=ours.head_dim,
        expand_v=ours.expand_v,
        allow_neg_eigval=ours.allow_neg_eigval,
        conv_size=ours.conv_size,
        conv_bias=False,
        norm_eps=ours.norm_eps,
        use_experimental_kernels=False,
    )


def router_config(
    moe: MoEConfig,
    d_model: int,
    eos_token_id: int,
    *,
    lb_w: float,
    z_w: float,
    global_load_balancing: bool = False,
):
    """OLMo-core's `MoERouterConfigV2` for our `MoEConfig` (EMO on, local-batch LB loss; global
    load balancing needs a process group, see `goldens.model`)."""
    from olmo_core.nn.moe.emo import EmoRouterConfig
    from olmo_core.nn.moe.v2.router import MoERouterConfigV2

    emo: EmoConfig = moe.emo
    return MoERouterConfigV2(
        d_model=d_model,
        num_experts=moe.num_experts,
        top_k=moe.top_k,
        normalize_expert_weights=1.0 if moe.normalize_expert_weights else None,
        restore_weight_scale=moe.restore_weight_scale,
        lb_loss_weight=lb_w,
        z_loss_weight=z_w,
        global_load_balancing=global_load_balancing,
        emo=EmoRouterConfig(
            eos_token_id=eos_token_id,
            min_document_expert_pool=emo.min_pool,
            max_document_expert_pool=emo.max_pool,
            eval_document_expert_pool=emo.eval_pool,
        ),
    )


def block_config(
    cfg: ModelConfig,
    layer_type: str,
    *,
    dense: bool,
    lb_loss_weight: float = _TRAIN_DEFAULTS["lb_loss_weight"],
    router_z_loss_weight: float = _TRAIN_DEFAULTS["router_z_loss_weight"],
    global_load_balancing: bool = True,
):
    """`OLMoDDPTransformerBlockConfig` of a peri-norm block: `layer_type` mixer ("kda" or
    "attention"), a dense SwiGLU of width `cfg.dense_hidden` (a shared-experts module with one
    expert) or the latent MoE with its shared expert and EMO router."""
    from olmo_core.config import DType
    from olmo_core.nn.ddp.block import OLMoDDPTransformerBlockConfig
    from olmo_core.nn.moe.moe import LatentMoEConfig
    from olmo_core.nn.moe.v2.routed_experts import RoutedExpertsConfig
    from olmo_core.nn.moe.v2.shared_experts import SharedExpertsConfig
    from olmo_core.nn.transformer.config import TransformerBlockType

    mixers = {
        "kda": lambda: kda_config(cfg.kda),
        "attention": lambda: attention_config(cfg.attention),
    }
    moe = cfg.moe
    shared_hidden = cfg.dense_hidden if dense else moe.shared_expert_hidden
    moe_parts = {}
    if not dense:
        moe_parts = dict(
            routed_experts=RoutedExpertsConfig(
                d_model=moe.latent_dim,
                hidden_size=moe.expert_hidden,
                num_experts=moe.num_experts,
                bias=False,
                dtype=DType.float32,
            ),
            routed_experts_router=router_config(
                moe,
                cfg.d_model,
                cfg.eos_token_id,
                lb_w=lb_loss_weight,
                z_w=router_z_loss_weight,
                global_load_balancing=global_load_balancing,
            ),
            latent_moe=LatentMoEConfig(latent_dim=moe.latent_dim),
        )
    return OLMoDDPTransformerBlockConfig(
        name=TransformerBlockType.moe_fused_v2,
        sequence_mixer=mixers[layer_type](),
        layer_norm=rms_norm_config(cfg.norm_eps),
        shared_experts=SharedExpertsConfig(
            d_model=cfg.d_model,
            hidden_size=shared_hidden,
            num_experts=1,
            bias=False,
            dtype=DType.float32,
        ),
        use_peri_norm=True,
        use_pre_norm=False,
        **moe_parts,
    )


def model_config(
    cfg: ModelConfig, *, init_seed: int = _TRAIN_DEFAULTS["init_seed"], **block_kwargs
):
    """`OLMoDDPModelConfig` of `cfg`: one named block per (mixer, dense or MoE) kind, the layer
    pattern from `cfg.layer_types` and `cfg.dense_layers`; `block_kwargs` go to `block_config`."""
    from olmo_core.nn.lm_head import LMHeadConfig
    from olmo_core.nn.transformer.config import InitMethod, OLMoDDPModelConfig, TransformerType

    pattern = [
        f"{t}_{'dense' if i in cfg.dense_layers else 'moe'}" for i, t in enumerate(cfg.layer_types)
    ]
    blocks = {
        name: block_config(cfg, name.split("_")[0], dense=name.endswith("dense"), **block_kwargs)
        for name in sorted(set(pattern))
    }
    return OLMoDDPModelConfig(
        name=TransformerType.moe_fused_v2,
        d_model=cfg.d_model,
        vocab_size=cfg.vocab_size,
        n_layers=cfg.n_layers,
        block=blocks,
        block_pattern=pattern,
        lm_head=LMHeadConfig(layer_norm=rms_norm_config(cfg.norm_eps), bias=False),
        embedding_norm=rms_norm_config(cfg.norm_eps),
        embed_scale=cfg.embed_scale,
        tie_word_embeddings=False,
        init_method=InitMethod.normal,
        init_seed=init_seed,
        init_std=cfg.init_std,
    )


def build(cfg: ModelConfig, **config_kwargs):
    """OLMo-core's `OLMoDDPModel` of `cfg` on this CPU, float32, initialised by OLMo-core;
    `config_kwargs` go to `model_config`."""
    import torch
    from olmo_core.nn.ddp.model import OLMoDDPModel

    from goldens.runtime.standins import install, install_moe

    install()
    install_moe()
    OLMoDDPModel._training_dtype = torch.float32
    model = model_config(cfg, **config_kwargs).build(init_device="cpu")
    model.init_weights(device=torch.device("cpu"))
    return model
