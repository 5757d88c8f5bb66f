"""Model FLOPs of a train step, by the named scope that computes them, and the chips' peaks they
are measured against (MFU).

3 x tokens x (2 N + attention + KDA) per step, tokens = global batch x seq_len, fwd + bwd =
3 x fwd; per token:
N = active params (routed experts top_k of num_experts) less the embedding table (a lookup);
attention = 2 T h d_h per attention layer (QK^T and PV over T/2 causal keys on average);
KDA = h (3 C K + 2 C V + C^2 / 3 + 6 K V) per KDA layer, chunk C, head dims K, V: the chunk's
  lower triangles A_kk, A_qk, T(Gamma k), T v (intra-chunk), (I + A)^-1 (the inverse), then
  A_qk v' and the state [K, V] read by w and q and updated once (the inter-chunk scan).
`scope_flops` splits them by the `jax.named_scope` of the model that runs each matmul (the
profile's op families, `parity.profile.FAMILIES`); `UNSCOPED` holds the dense feed-forwards'
and the norms'.
"""

from __future__ import annotations

from model.config import Config

UNSCOPED = "unscoped"
"""`scope_flops`' key for the FLOPs of no named scope: the dense feed-forwards and the norms."""
PEAK_FLOPS = {"TPU v4": 275e12, "TPU v5 lite": 197e12, "TPU v5": 459e12, "TPU v6 lite": 918e12}
"""bfloat16 matmul peak of one chip, by JAX's device kind (Google Cloud's TPU pages)."""


def scope_flops(cfg: Config) -> dict[str, float]:
    """Model FLOPs of one train step of `cfg` by named scope (the module docstring's formula,
    split); they sum to `step_flops`."""
    m, train = cfg.model, cfg.train
    tokens, T, d = train.global_batch_size * train.seq_len, train.seq_len, m.d_model
    n_kda, n_attention = m.layer_types.count("kda"), m.layer_types.count("attention")
    n_moe, moe, a = len(m.moe_layers), m.moe, m.attention
    h, C, K, V = m.kda.n_heads, m.kda.chunk_size, m.kda.head_dim, m.kda.head_v_dim
    shared = 0 if moe.shared_expert_hidden is None else 3 * d * moe.shared_expert_hidden
    dense = len(m.dense_layers) * 3 * d * m.dense_hidden
    per_token = {  # forward, one token
        "vocab_loss": 2 * d * m.vocab_size,
        "kda": n_kda * 2 * m.kda.num_params(d),
        "kda_intra_chunk": n_kda * h * (3 * C * K + C * V),
        "kda_inverse": n_kda * h * C**2 / 3,
        "kda_inter_chunk": n_kda * h * (C * V + 6 * K * V),
        "attention": n_attention * (2 * a.num_params(d) + 2 * T * a.n_heads * a.head_dim),
        "router": n_moe * 2 * moe.num_experts * d,
        "grouped_matmul": n_moe * 2 * moe.top_k * moe.num_routed_params() // moe.num_experts,
        "moe": n_moe * 2 * (2 * d * moe.latent_dim + shared),
        UNSCOPED: 2 * (dense + m.n_layers * 4 * d + 2 * d),  # peri-norms, embedding and head norms
    }
    return {scope: 3 * tokens * flops for scope, flops in per_token.items()}


def step_flops(cfg: Config) -> float:
    """Model FLOPs of one train step of `cfg` (the module docstring's formula)."""
    return sum(scope_flops(cfg).values())


def fraction_of_peak(cfg: Config, step_seconds: float, device_kind: str) -> float | None:
    """Model FLOP/s of a step over the chip's bfloat16 peak; None for a chip not in
    `PEAK_FLOPS` (a CPU)."""
    peak = PEAK_FLOPS.get(device_kind)
    return None if peak is None else step_flops(cfg) / step_seconds / peak
