"""Which kernel computes each op of a train step that has a choice of them, as the model chooses
(`model.moe.grouped_matmul_kernel`, `model.kda.intra_chunk_kernel`,
`model.attention.attention_kernel`). A record names them: the same
config runs other kernels on another platform, and lockstep on a TPU runs the micro config,
whose widths are below the TPU kernels'."""

from __future__ import annotations

import dataclasses

from model.attention import attention_kernel
from model.config import Config
from model.kda import intra_chunk_kernel
from model.moe import grouped_matmul_kernel


@dataclasses.dataclass(frozen=True)
class StepKernels:
    grouped_matmul: str
    """The routed experts' matmuls: "megablox" (Pallas, on a TPU where the widths are whole 128
    lanes), "ragged_dot" (XLA's) or "tiles" (a batched matmul over tiles of one expert's tokens,
    the CPU's)."""
    kda_intra_chunk: str | None
    """KDA's intra-chunk scores: "pallas" (`model.kda_pallas`) or "xla"; None without KDA."""
    attention: str | None
    """Attention's softmax over the keys: "pallas" (`model.attention_pallas`) or "xla"; None
    without an attention layer."""


def step_kernels(cfg: Config, platform: str) -> StepKernels:
    """The kernels `cfg`'s train step runs on `platform` ("cpu", "tpu", ...)."""
    m = cfg.model
    kda = intra_chunk_kernel(cfg.scale.kda_kernel, m.kda, platform)
    attention = attention_kernel(
        cfg.scale.attention_kernel, m.attention, cfg.train.seq_len, platform
    )
    return StepKernels(
        grouped_matmul=grouped_matmul_kernel(platform, m.moe.latent_dim, m.moe.expert_hidden),
        kda_intra_chunk=kda if "kda" in m.layer_types else None,
        attention=attention if "attention" in m.layer_types else None,
    )
