"""Model FLOPs of a train step, and the chips' peaks they are measured against (MFU).

3 x tokens x (2 N + attention + KDA) per step, tokens = global batch x seq_len, fwd + bwd =
3 x fwd; per token:
N = active params (routed experts top_k of num_experts) less the embedding table (a lookup);
attention = 2 T h d_h per attention layer (QK^T and PV over T/2 causal keys on average);
KDA = h (3 C K + 2 C V + C^2 / 3 + 6 K V) per KDA layer, chunk C, head dims K, V: the chunk's
  lower triangles A_kk, A_qk, T(Gamma k), T v, A_qk v' and (I + A)^-1, then the state
  [K, V] read by w and q and updated once.
"""

from __future__ import annotations

from model.config import Config

PEAK_FLOPS = {"TPU v4": 275e12, "TPU v5 lite": 197e12, "TPU v5": 459e12, "TPU v6 lite": 918e12}
"""bfloat16 matmul peak of one chip, by JAX's device kind (Google Cloud's TPU pages)."""


def step_flops(cfg: Config) -> float:
    """Model FLOPs of one train step of `cfg` (the module docstring's formula)."""
    m, train = cfg.model, cfg.train
    tokens, T = train.global_batch_size * train.seq_len, train.seq_len
    n = m.num_active_params() - m.vocab_size * m.d_model
    attention = 2 * T * m.attention.n_heads * m.attention.head_dim
    C, K, V = m.kda.chunk_size, m.kda.head_dim, m.kda.head_v_dim
    kda = m.kda.n_heads * (3 * C * K + 2 * C * V + C**2 / 3 + 6 * K * V)
    per_token = (
        2 * n + m.layer_types.count("attention") * attention + m.layer_types.count("kda") * kda
    )
    return 3 * tokens * per_token


def fraction_of_peak(cfg: Config, step_seconds: float, device_kind: str) -> float | None:
    """Model FLOP/s of a step over the chip's bfloat16 peak; None for a chip not in
    `PEAK_FLOPS` (a CPU)."""
    peak = PEAK_FLOPS.get(device_kind)
    return None if peak is None else step_flops(cfg) / step_seconds / peak
