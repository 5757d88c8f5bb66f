"""Frozen, validated configs: model shape, training recipe and the OLMo-core parity flags.

OLMo-core 3.0.0 counterparts: `OLMoDDPModelConfig` / `OLMoDDPTransformerBlockConfig` (ModelConfig),
`KimiDeltaAttentionConfig` (KDAConfig), `AttentionConfig` (AttentionConfig), `MoERouterConfigV2` +
`RoutedExpertsConfig` + `LatentMoEConfig` + `SharedExpertsConfig` + `EmoRouterConfig` (MoEConfig,
EmoConfig), `OLMoDDPTrainModuleConfig` + `OLMoDDPOptimizerConfig` + a scheduler (TrainConfig).
`Flags` holds the switches of the MaxText replay PR (shared/seeds); each default is plain MaxText
behaviour and `olmo_core()` turns them all to OLMo-core's.

Every config validates itself at construction and raises `ValueError("<Class>.<field>: ...")`.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

LAYER_TYPES = ("kda", "attention")
SCHEDULES = ("constant_with_warmup", "cosine", "linear", "wsd")
AUX_LOSS_REDUCTIONS = ("mean", "sum")
KDA_INVERSES = ("forward_substitution", "newton_schulz", "power_series")
POSITIONAL_ENCODINGS = ("none",)
COMPUTE_DTYPES = ("float32", "float64", "bfloat16")
ROUTER_DTYPES = (None, "bfloat16")
MESH_AXES = ("data", "fsdp", "expert")
"""The mesh axes of `model.layout`: data parallel, fully sharded data parallel, experts."""
LOGICAL_AXIS_RULES = (
    ("batch", ("data", "fsdp", "expert")),
    ("experts", ("expert",)),
    ("embed", ("fsdp",)),
    ("mlp", ("fsdp",)),
    ("latent", ("fsdp",)),
    ("heads", ("fsdp",)),
    ("kv", ("fsdp",)),
    ("vocab", ()),
    ("length", ()),
)
"""Logical axis -> the mesh axes it is split over, as MaxText's `logical_axis_rules`. Rows split
over every axis (the expert axis shards the batch outside the MoE), routed experts over "expert",
and every weight over "fsdp" along its first axis that takes it (`model.layout.Layout.spec`)."""
REMAT_POLICIES = ("none", "full", "save_matmuls")
KDA_KERNELS = ("xla", "pallas")
ATTENTION_KERNELS = ("xla", "pallas")
MATMUL_PRECISIONS = ("default", "high", "highest")
"""JAX's matmul precisions (`jax.default_matmul_precision`). On a TPU a float32 matmul takes one
bfloat16 pass at "default", three at "high" and six at "highest" (float32's accuracy); a CPU
multiplies float32 in float32 at each."""


class _Config:
    """Validation and serialisation shared by every config dataclass."""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:  # overridden where there is something to check
        pass

    def _require(self, ok: bool, name: str, message: str) -> None:
        if not ok:
            raise ValueError(f"{type(self).__name__}.{name}: {message}")

    def _positive(self, *names: str) -> None:
        for name in names:
            value = getattr(self, name)
            self._require(value > 0, name, f"must be > 0, got {value!r}")

    def as_dict(self) -> dict[str, Any]:
        """Plain JSON-able dict (tuples become lists), for snapshots and manifests."""
        return _plain(dataclasses.asdict(self))


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


@dataclass(frozen=True)
class KDAConfig(_Config):
    """Kimi Delta Attention mixer (OLMo-core `KimiDeltaAttentionConfig`; conv without bias)."""

    n_heads: int
    """Heads for q, k and v (OLMo-core requires n_v_heads == n_heads)."""
    head_dim: int
    """Key head dim d_k."""
    expand_v: float = 2.0
    """Value head dim d_v = head_dim * expand_v."""
    allow_neg_eigval: bool = True
    """beta = 2 sigmoid(.) instead of sigmoid(.): eigenvalues of (I - beta k k^T) down to -1."""
    conv_size: int = 4
    """Causal depthwise short-convolution width on q, k, v."""
    norm_eps: float = 1e-5
    """Eps of the sigmoid-gated output RMSNorm."""
    chunk_size: int = 64
    """Tokens per chunk of the chunked kernel (FLA's 64)."""

    def validate(self) -> None:
        self._positive("n_heads", "head_dim", "expand_v", "conv_size", "norm_eps", "chunk_size")
        v = self.head_dim * self.expand_v
        self._require(v == int(v), "expand_v", f"head_dim * expand_v must be whole, got {v}")

    @property
    def head_v_dim(self) -> int:
        return int(self.head_dim * self.expand_v)

    def num_params(self, d_model: int) -> int:
        """Parameter count of one layer, as OLMo-core's `KimiDeltaAttentionConfig.num_params`."""
        h, dk, dv = self.n_heads, self.head_dim, self.head_v_dim
        qk, v = h * dk, h * dv
        projections = d_model * (2 * qk + v) + v * d_model  # w_q, w_k, w_v, w_out
        decay = d_model * dv + dv * qk  # f_proj_1, f_proj_2 (low rank d_v)
        gate = d_model * dv + dv * v + v  # g_proj_1, g_proj_2 (with bias)
        conv = self.conv_size * (2 * qk + v)
        return (
            projections + decay + gate + conv + d_model * h + h + qk + dv
        )  # w_b, A_log, dt_bias, o_norm


@dataclass(frozen=True)
class AttentionConfig(_Config):
    """Gated full attention (OLMo-core `AttentionConfig`): per-head QK RMSNorm with per-head
    gains, scalable softmax with a learned per-head scale, elementwise sigmoid output gate."""

    n_heads: int
    """Query heads."""
    n_kv_heads: int
    """Key/value heads (grouped-query attention); divides n_heads."""
    head_dim: int
    qk_norm_eps: float = 1e-6
    positional_encoding: str = "none"
    """Only "none" (NoPE, as the hero) is implemented."""

    def validate(self) -> None:
        self._positive("n_heads", "n_kv_heads", "head_dim", "qk_norm_eps")
        self._require(
            self.n_heads % self.n_kv_heads == 0,
            "n_kv_heads",
            f"must divide n_heads={self.n_heads}, got {self.n_kv_heads}",
        )
        self._require(
            self.positional_encoding in POSITIONAL_ENCODINGS,
            "positional_encoding",
            f"must be one of {POSITIONAL_ENCODINGS} (the hero is NoPE), "
            f"got {self.positional_encoding!r}",
        )

    def num_params(self, d_model: int) -> int:
        q, kv = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        projections = (
            d_model * (q + 2 * kv) + q * d_model + d_model * q
        )  # w_q, w_k, w_v, w_out, w_g
        return projections + q + kv + self.n_heads  # q_norm, k_norm gains, ssmax_scale


@dataclass(frozen=True)
class EmoConfig(_Config):
    """EMO document expert pools (OLMo-core `EmoRouterConfig`): each EOS-delimited document keeps
    only its top-`pool` experts; the pool is drawn uniformly in [min_pool, max_pool] per document
    in training and is `eval_pool` in evaluation."""

    min_pool: int
    max_pool: int
    eval_pool: int

    def validate(self) -> None:
        self._positive("min_pool")
        self._require(
            self.min_pool <= self.max_pool,
            "max_pool",
            f"must be >= min_pool={self.min_pool}, got {self.max_pool}",
        )
        self._positive("eval_pool")


@dataclass(frozen=True)
class MoEConfig(_Config):
    """Latent MoE feed-forward (OLMo-core v2: `MoERouterConfigV2`, `RoutedExpertsConfig`,
    `LatentMoEConfig`, `SharedExpertsConfig`): softmax router over all experts, top-k, SwiGLU
    experts in a latent space, one optional shared expert added to the routed output."""

    num_experts: int
    top_k: int
    expert_hidden: int
    """SwiGLU hidden size of each routed expert."""
    latent_dim: int
    """Width the routed experts work in (down/up projections around them)."""
    shared_expert_hidden: int | None
    """Hidden size of the single shared SwiGLU expert; None for no shared expert."""
    normalize_expert_weights: bool = True
    """L1-normalise the selected router weights (OLMo-core normalize_expert_weights=1.0)."""
    restore_weight_scale: bool = True
    """Multiply the normalised weights by top_k."""
    emo: EmoConfig | None = None
    router_dtype: str | None = None
    """The router matmul's dtype: None is full precision (OLMo-core's float32; float64 in a
    float64 model), "bfloat16" MaxText's activation dtype."""

    def validate(self) -> None:
        self._positive("num_experts", "top_k", "expert_hidden", "latent_dim")
        self._require(
            self.router_dtype in ROUTER_DTYPES,
            "router_dtype",
            f"must be one of {ROUTER_DTYPES}, got {self.router_dtype!r}",
        )
        self._require(
            self.top_k <= self.num_experts,
            "top_k",
            f"must be <= num_experts={self.num_experts}, got {self.top_k}",
        )
        if self.shared_expert_hidden is not None:
            self._positive("shared_expert_hidden")
        if self.emo is not None:
            self._require(
                self.top_k <= self.emo.min_pool and self.emo.max_pool <= self.num_experts,
                "emo",
                f"pools must satisfy top_k={self.top_k} <= min_pool={self.emo.min_pool} and "
                f"max_pool={self.emo.max_pool} <= num_experts={self.num_experts}",
            )
            self._require(
                self.top_k <= self.emo.eval_pool <= self.num_experts,
                "emo",
                f"eval_pool={self.emo.eval_pool} must lie in [top_k={self.top_k}, "
                f"num_experts={self.num_experts}]",
            )

    def num_routed_params(self) -> int:
        return self.num_experts * 3 * self.expert_hidden * self.latent_dim

    def num_params(self, d_model: int) -> int:
        """Router + routed experts + latent projections + shared expert of one MoE block."""
        shared = 0 if self.shared_expert_hidden is None else 3 * d_model * self.shared_expert_hidden
        router = self.num_experts * d_model
        return router + self.num_routed_params() + 2 * d_model * self.latent_dim + shared


@dataclass(frozen=True)
class ModelConfig(_Config):
    """The olmo35 hybrid (OLMo-core `OLMoDDPModelConfig`, blocks `moe_fused_v2`): peri-norm blocks
    of a KDA or attention mixer and a dense (listed in `dense_layers`) or MoE feed-forward;
    embedding scaled by sqrt(d_model) then RMSNorm; untied LM head with its own RMSNorm."""

    d_model: int
    n_layers: int
    vocab_size: int
    eos_token_id: int
    layer_types: tuple[str, ...]
    """Mixer of each block, "kda" or "attention"; length n_layers."""
    dense_layers: tuple[int, ...]
    """Blocks whose feed-forward is a dense SwiGLU of width dense_hidden (the hero: block 0)."""
    dense_hidden: int
    kda: KDAConfig
    attention: AttentionConfig
    moe: MoEConfig
    norm_eps: float = 1e-6
    """Eps of every block, embedding and LM-head RMSNorm."""
    init_std: float = 0.02
    compute_dtype: str = "float32"
    """"float32"; "float64" (params too; needs jax_enable_x64) to compare with OLMo-core in
    float64; "bfloat16" activations with float32 params and float32 norms, softmaxes, router, KDA
    and losses (MaxText's training precision). See `model.precision`."""

    def validate(self) -> None:
        self._positive("d_model", "n_layers", "vocab_size", "dense_hidden", "norm_eps", "init_std")
        self._require(
            self.compute_dtype in COMPUTE_DTYPES,
            "compute_dtype",
            f"must be one of {COMPUTE_DTYPES}, got {self.compute_dtype!r}",
        )
        self._require(
            0 <= self.eos_token_id < self.vocab_size,
            "eos_token_id",
            f"must lie in [0, vocab_size={self.vocab_size}), got {self.eos_token_id}",
        )
        self._require(
            len(self.layer_types) == self.n_layers,
            "layer_types",
            f"needs one entry per layer (n_layers={self.n_layers}), got {len(self.layer_types)}",
        )
        unknown = sorted(set(self.layer_types) - set(LAYER_TYPES))
        self._require(not unknown, "layer_types", f"unknown {unknown}; allowed {LAYER_TYPES}")
        self._require(
            list(self.dense_layers) == sorted(set(self.dense_layers))
            and all(0 <= i < self.n_layers for i in self.dense_layers),
            "dense_layers",
            f"must be increasing block indices in [0, {self.n_layers}), got {self.dense_layers}",
        )
        self._require(
            len(self.dense_layers) < self.n_layers,
            "dense_layers",
            "at least one block must have the MoE feed-forward (the hybrid has no dense-only form)",
        )

    @property
    def embed_scale(self) -> float:
        return math.sqrt(self.d_model)

    @property
    def moe_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.n_layers) if i not in self.dense_layers)

    def num_params(self) -> int:
        """Total parameters, as OLMo-core's `OLMoDDPModelConfig.num_params`."""
        d = self.d_model
        mixers = sum(
            self.kda.num_params(d) if t == "kda" else self.attention.num_params(d)
            for t in self.layer_types
        )
        ffns = len(self.dense_layers) * 3 * d * self.dense_hidden
        ffns += len(self.moe_layers) * self.moe.num_params(d)
        embeddings, lm_head = self.vocab_size * d + d, self.vocab_size * d + d
        return embeddings + lm_head + mixers + ffns + self.n_layers * 4 * d  # 4 peri-norms a block

    def num_active_params(self) -> int:
        """Parameters touched per token: routed experts count top_k of num_experts."""
        inactive = self.moe.num_routed_params() * (self.moe.num_experts - self.moe.top_k)
        return self.num_params() - len(self.moe_layers) * inactive // self.moe.num_experts


@dataclass(frozen=True)
class TrainConfig(_Config):
    """The recipe (OLMo-core `OLMoDDPTrainModuleConfig` + `OLMoDDPOptimizerConfig`, which is
    `SkipStepAdamW` with clipping, + a scheduler). Weights of the losses are as OLMo-core's:
    CE z-loss multiplier, router load-balancing and router z-loss weights per MoE layer."""

    seq_len: int
    global_batch_size: int
    """Instances (rows of seq_len tokens) per optimizer step."""
    ga_steps: int
    """Micro-batches per optimizer step; divides global_batch_size."""
    lr: float
    warmup_steps: int
    max_steps: int
    schedule: str = "constant_with_warmup"
    alpha_f: float = 0.1
    """Final LR as a fraction of lr, for "cosine" and "linear"."""
    decay_fraction: float = 0.1
    """Share of max_steps spent in the final linear decay of "wsd"."""
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.1
    embedding_weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    vocab_tiles: int = 1
    """Tiles the LM head + CE is computed in (1: untiled); `Flags.vocab_tiling_seq_major` picks
    the axis they split."""
    skip_step_sigma: float = 6.0
    """A step is skipped when loss or grad norm exceeds mean + sigma * std of recent steps."""
    skip_step_window: int = 128
    z_loss_weight: float = 1e-5
    lb_loss_weight: float = 0.01
    router_z_loss_weight: float = 1e-5
    init_seed: int = 12536
    data_seed: int = 928543231

    def validate(self) -> None:
        self._positive("seq_len", "global_batch_size", "ga_steps", "lr", "max_steps", "eps")
        self._positive("max_grad_norm", "vocab_tiles", "skip_step_sigma", "skip_step_window")
        self._require(
            self.global_batch_size % self.ga_steps == 0,
            "ga_steps",
            f"must divide global_batch_size={self.global_batch_size}, got {self.ga_steps}",
        )
        self._require(
            0 <= self.warmup_steps <= self.max_steps,
            "warmup_steps",
            f"must lie in [0, max_steps={self.max_steps}], got {self.warmup_steps}",
        )
        self._require(
            self.schedule in SCHEDULES,
            "schedule",
            f"must be one of {SCHEDULES}, got {self.schedule!r}",
        )
        self._require(
            len(self.betas) == 2 and all(0.0 <= b < 1.0 for b in self.betas),
            "betas",
            f"must be two values in [0, 1), got {self.betas!r}",
        )
        for name in ("alpha_f", "decay_fraction"):
            value = getattr(self, name)
            self._require(0.0 <= value <= 1.0, name, f"must lie in [0, 1], got {value}")
        for name in (
            "weight_decay",
            "embedding_weight_decay",
            "z_loss_weight",
            "lb_loss_weight",
            "router_z_loss_weight",
        ):
            value = getattr(self, name)
            self._require(value >= 0.0, name, f"must be >= 0, got {value}")

    @property
    def micro_batch_size(self) -> int:
        return self.global_batch_size // self.ga_steps


@dataclass(frozen=True)
class Flags(_Config):
    """The replay PR's switches. Defaults are plain MaxText; see `olmo_core()` for OLMo-core's."""

    moe_global_load_balancing: bool = False
    """Average expert token counts over data devices (no grad) before the LB loss; log the mean
    over devices, not device 0's."""
    olmo_segment_ids_from_eos: int | None = None
    """EOS id: segment ids from EOS (`eos.cumsum() - eos + 1`, on inputs of length L)."""
    olmoe3_mixers_ignore_segment_ids: bool = False
    """Attention and KDA see the whole instance; only the EMO pools use segment ids."""
    moe_aux_loss_reduction: str = "mean"
    """Combine the MoE aux losses of all layers by "sum" (OLMo-core) or "mean" (MaxText)."""
    warmup_step_offset: int = 0
    """Added to the step before the LR schedule; OLMo-core's first step is step 1."""
    olmo_global_indices_path: str | None = None
    """OLMo-core global-indices file: global batch k is OLMo-core's batch k."""
    kda_inverse: str = "forward_substitution"
    """How the KDA chunk system (I + A) is inverted; the other two overflow on trained keys and
    are kept only to show that."""
    vocab_tiling_seq_major: bool = False
    """Vocab tiles of LM head + CE split along the sequence, not the flattened batch."""
    ga_params_loop_barrier: bool = False
    """Optimisation barrier on the params inside the GA loop (memory; no OLMo-core counterpart)."""

    def validate(self) -> None:
        self._require(
            self.moe_aux_loss_reduction in AUX_LOSS_REDUCTIONS,
            "moe_aux_loss_reduction",
            f"must be one of {AUX_LOSS_REDUCTIONS}, got {self.moe_aux_loss_reduction!r}",
        )
        self._require(
            self.kda_inverse in KDA_INVERSES,
            "kda_inverse",
            f"must be one of {KDA_INVERSES}, got {self.kda_inverse!r}",
        )
        self._require(
            self.warmup_step_offset >= 0,
            "warmup_step_offset",
            f"must be >= 0, got {self.warmup_step_offset}",
        )
        if self.olmo_segment_ids_from_eos is not None:
            self._require(
                self.olmo_segment_ids_from_eos >= 0,
                "olmo_segment_ids_from_eos",
                f"must be a token id >= 0 or None, got {self.olmo_segment_ids_from_eos}",
            )


@dataclass(frozen=True)
class ScaleConfig(_Config):
    """How a run is laid out at scale: where each logical axis lives on the mesh, what each block
    keeps for the backward pass (neither changes the maths), and how precisely the chip
    multiplies."""

    logical_axis_rules: tuple[tuple[str, tuple[str, ...]], ...] = LOGICAL_AXIS_RULES
    remat_policy: str = "none"
    """Per block, as MaxText's `remat_policy`: "none" keeps every activation, "full" keeps only
    the block's input and recomputes the rest, "save_matmuls" keeps the matmul outputs."""
    vocab_tiles_keep_logits: bool = False
    """Vocab tiles (`TrainConfig.vocab_tiles` > 1) keep their logits, in the compute dtype, for
    the backward pass: one LM-head matmul of four saved, at the cost of [tokens, V] logits held
    (False: each tile recomputes them; untiled, autodiff keeps them either way)."""
    matmul_precision: str | None = None
    """Precision of every matmul, einsum and Pallas matmul of the train step, one of
    `MATMUL_PRECISIONS`; None: "highest" for float32 and float64 compute, "default" for bfloat16
    (`model.precision.matmul_precision`)."""
    kda_kernel: str = "pallas"
    """What computes KDA's intra-chunk scores, one of `KDA_KERNELS`: "pallas", the Pallas TPU
    kernel (`model.kda_pallas`) where the step compiles for a TPU and a chunk fits it (head dim
    in whole 128 lanes), XLA's ops elsewhere; "xla", XLA's ops everywhere."""
    attention_kernel: str = "pallas"
    """What computes attention's softmax over the keys, one of `ATTENTION_KERNELS`: "pallas",
    the Pallas TPU flash attention kernel (`model.attention_pallas`) where the step compiles for
    a TPU and the sequence and heads fit it (whole 128 lanes), XLA's ops elsewhere; "xla", XLA's
    ops everywhere."""

    def validate(self) -> None:
        self._require(
            self.kda_kernel in KDA_KERNELS,
            "kda_kernel",
            f"must be one of {KDA_KERNELS}, got {self.kda_kernel!r}",
        )
        self._require(
            self.attention_kernel in ATTENTION_KERNELS,
            "attention_kernel",
            f"must be one of {ATTENTION_KERNELS}, got {self.attention_kernel!r}",
        )
        self._require(
            self.remat_policy in REMAT_POLICIES,
            "remat_policy",
            f"must be one of {REMAT_POLICIES}, got {self.remat_policy!r}",
        )
        self._require(
            self.matmul_precision is None or self.matmul_precision in MATMUL_PRECISIONS,
            "matmul_precision",
            f"must be one of {MATMUL_PRECISIONS} or None, got {self.matmul_precision!r}",
        )
        names = [name for name, _ in self.logical_axis_rules]
        self._require(
            len(names) == len(set(names)),
            "logical_axis_rules",
            f"each logical axis needs one rule, got {names}",
        )
        for name, axes in self.logical_axis_rules:
            unknown = sorted(set(axes) - set(MESH_AXES))
            self._require(
                not unknown,
                "logical_axis_rules",
                f"{name!r} maps to {unknown}, not mesh axes {MESH_AXES}",
            )


@dataclass(frozen=True)
class Config(_Config):
    """A whole run: model, recipe, flags and layout, checked against each other."""

    model: ModelConfig
    train: TrainConfig
    flags: Flags = field(default_factory=Flags)
    scale: ScaleConfig = field(default_factory=ScaleConfig)

    def validate(self) -> None:
        eos = self.flags.olmo_segment_ids_from_eos
        self._require(
            eos is None or eos == self.model.eos_token_id,
            "flags",
            f"olmo_segment_ids_from_eos={eos} differs from model.eos_token_id="
            f"{self.model.eos_token_id}",
        )
        self._require(
            self.model.vocab_size % self.train.vocab_tiles == 0,
            "train",
            f"vocab_tiles={self.train.vocab_tiles} must divide model.vocab_size="
            f"{self.model.vocab_size} (the backward pass walks the vocabulary in as many tiles)",
        )


def olmo_core(config: Config, *, global_indices_path: str | None = None) -> Config:
    """`config` with every flag switched to OLMo-core behaviour.

    `ga_params_loop_barrier` stays off: it is a memory layout choice with no OLMo-core meaning.
    `olmo_global_indices_path` is set only when a global-indices file is given.
    """
    flags = dataclasses.replace(
        config.flags,
        moe_global_load_balancing=True,
        olmo_segment_ids_from_eos=config.model.eos_token_id,
        olmoe3_mixers_ignore_segment_ids=True,
        moe_aux_loss_reduction="sum",
        warmup_step_offset=1,
        olmo_global_indices_path=global_indices_path,
        kda_inverse="forward_substitution",
        vocab_tiling_seq_major=True,
    )
    return dataclasses.replace(config, flags=flags)


def hybrid_layer_types(n_layers: int, attention_every: int) -> tuple[str, ...]:
    """KDA everywhere except attention at every `attention_every`-th block (7, 15, ... for 8)."""
    return tuple("attention" if (i + 1) % attention_every == 0 else "kda" for i in range(n_layers))


def olmo35_tiny() -> Config:
    """The hero: OLMo-core `olmo35-small-hero-20260907` = MaxText `olmo35-tiny`
    (12,496,341,632 parameters, 794,233,472 active)."""
    model = ModelConfig(
        d_model=1024,
        n_layers=16,
        vocab_size=100352,
        eos_token_id=100257,
        layer_types=hybrid_layer_types(16, attention_every=8),
        dense_layers=(0,),
        dense_hidden=8192,
        kda=KDAConfig(n_heads=8, head_dim=128),
        attention=AttentionConfig(n_heads=8, n_kv_heads=4, head_dim=128),
        moe=MoEConfig(
            num_experts=512,
            top_k=16,
            expert_hidden=1024,
            latent_dim=512,
            shared_expert_hidden=1024,
            emo=EmoConfig(min_pool=16, max_pool=512, eval_pool=512),
        ),
    )
    train = TrainConfig(
        seq_len=8192,
        global_batch_size=2048,  # 16,777,216 tokens
        ga_steps=8,  # 64 GPUs x micro-batch 4 x GA 8
        lr=1.1e-3,
        warmup_steps=2000,
        max_steps=834466,  # the 14T-token horizon
    )
    return Config(model=model, train=train)


def olmo35_slice(n_layers: int = 4) -> Config:
    """A slice of the hero that one TPU v5e chip trains: its widths (d_model 1024, vocab 100352,
    KDA 8 heads of 128, attention 8 / 4 heads of 128, routed experts of 1024 in a 512 latent, top
    16, a shared expert), `n_layers` blocks (block 0 dense; attention every 4th), 64 routed
    experts (EMO pools of 16 to 64); seq 4096, GA 8 of 1 sequence; bfloat16 activations, float32
    params and Adam; remat "none" (the 4 blocks' activations of one sequence fit the chip beside
    the state, and nothing is computed twice); 8 vocab tiles that keep their logits for the
    backward pass. `n_layers` 16 is the hero's depth."""
    hero, experts = olmo35_tiny(), 64
    model = dataclasses.replace(
        hero.model,
        n_layers=n_layers,
        layer_types=hybrid_layer_types(n_layers, attention_every=4),
        moe=dataclasses.replace(
            hero.model.moe,
            num_experts=experts,
            emo=dataclasses.replace(hero.model.moe.emo, max_pool=experts, eval_pool=experts),
        ),
        compute_dtype="bfloat16",
    )
    train = dataclasses.replace(
        hero.train, seq_len=4096, ga_steps=8, global_batch_size=8, vocab_tiles=8
    )
    scale = dataclasses.replace(hero.scale, remat_policy="none", vocab_tiles_keep_logits=True)
    return dataclasses.replace(hero, model=model, train=train, scale=scale)


def micro() -> Config:
    """The hero's structure at CPU size: goldens and a 50-step replay in minutes on 2 cores.
    Byte-level vocab (256 bytes + EOS, padded to 384); seq 256 gives KDA 4 chunks of 64."""
    model = ModelConfig(
        d_model=64,
        n_layers=8,
        vocab_size=384,
        eos_token_id=256,
        layer_types=hybrid_layer_types(8, attention_every=8),
        dense_layers=(0,),
        dense_hidden=512,  # 8 * d_model, the hero's ratio
        kda=KDAConfig(n_heads=2, head_dim=32),
        attention=AttentionConfig(n_heads=2, n_kv_heads=1, head_dim=32),
        moe=MoEConfig(
            num_experts=16,
            top_k=2,
            expert_hidden=64,
            latent_dim=32,
            shared_expert_hidden=64,
            emo=EmoConfig(min_pool=2, max_pool=16, eval_pool=16),
        ),
    )
    train = TrainConfig(
        seq_len=256,
        global_batch_size=8,
        ga_steps=2,
        lr=1e-3,
        warmup_steps=10,
        max_steps=50,
    )
    return Config(model=model, train=train)
