"""The peri-norm block, as OLMo-core's `OLMoDDPTransformerBlock` with `use_peri_norm=True`
(olmo_core/nn/ddp/block.py, 3.0.0): an RMSNorm before and after each sublayer.

    h   = x + attention_norm(mixer(attention_input_norm(x)))
    out = h + feed_forward_norm(ffn(feed_forward_input_norm(h)))

The mixer is KDA or attention (`ModelConfig.layer_types`). The feed-forward is one SwiGLU of width
`dense_hidden` in the blocks of `ModelConfig.dense_layers` (OLMo-core builds it as a shared-experts
module with one expert and no router), and the latent MoE with its shared expert elsewhere.
Children carry OLMo-core's names; the feed-forward's weights sit under `feed_forward` (OLMo-core
keeps them at block level, `model.convert` maps the two).
"""

from __future__ import annotations

import jax
from flax import nnx

from model.attention import Attention
from model.config import ModelConfig
from model.kda import KimiDeltaAttention
from model.layout import Layout
from model.moe import LatentMoE, MoEAux, SharedExpert
from model.norms import RMSNorm
from model.precision import compute_dtype

NORMS = ("attention_input_norm", "attention_norm", "feed_forward_input_norm", "feed_forward_norm")
"""The four peri-norms of a block, OLMo-core's names."""


class Block(nnx.Module):
    """Block `index` of `config`: x [B, T, d_model] -> (out [B, T, d_model], MoEAux or None).

    `ignore_segment_ids` is `Flags.olmoe3_mixers_ignore_segment_ids`, `kda_inverse`
    `Flags.kda_inverse`; every sublayer computes in `config.compute_dtype`."""

    def __init__(
        self,
        config: ModelConfig,
        index: int,
        *,
        ignore_segment_ids: bool,
        kda_inverse: str,
        rngs: nnx.Rngs,
    ):
        d, std = config.d_model, config.init_std
        dtype = compute_dtype(config.compute_dtype)
        layer_type = config.layer_types[index]
        if layer_type == "kda":
            self.attention = KimiDeltaAttention(
                config.kda,
                d,
                inverse=kda_inverse,
                ignore_segment_ids=ignore_segment_ids,
                std=std,
                dtype=dtype,
                rngs=rngs,
            )
        elif layer_type == "attention":
            self.attention = Attention(
                config.attention,
                d,
                ignore_segment_ids=ignore_segment_ids,
                std=std,
                dtype=dtype,
                rngs=rngs,
            )
        else:
            raise NotImplementedError(layer_type)
        self.is_moe = index not in config.dense_layers
        if self.is_moe:
            self.feed_forward = LatentMoE(config.moe, d, std=std, dtype=dtype, rngs=rngs)
        else:
            self.feed_forward = SharedExpert(
                d, config.dense_hidden, std=std, dtype=dtype, rngs=rngs
            )
        for name in NORMS:
            setattr(self, name, RMSNorm(d, eps=config.norm_eps, dtype=dtype))

    def __call__(
        self,
        x: jax.Array,
        *,
        document_ids: jax.Array,
        pools: jax.Array | None = None,
        loss_div_factor=None,
        lb_groups: int = 1,
        layout: Layout | None = None,
        kda_kernel: str = "pallas",
        attention_kernel: str = "pallas",
    ) -> tuple[jax.Array, MoEAux | None]:
        """document_ids [B, T] feed the EMO pools and, unless the mixer ignores them, its document
        masking; pools [B, T] per-document pool sizes (None: the eval pool); `loss_div_factor`,
        `lb_groups`, `layout`: as `LatentMoE`; `kda_kernel`: `ScaleConfig.kda_kernel`;
        `attention_kernel`: `ScaleConfig.attention_kernel`."""
        mixer_input = self.attention_input_norm(x)
        kernel = kda_kernel if isinstance(self.attention, KimiDeltaAttention) else attention_kernel
        mixed = self.attention(mixer_input, document_ids, kernel=kernel, layout=layout)
        h = x + self.attention_norm(mixed)
        m = self.feed_forward_input_norm(h)
        if not self.is_moe:
            return h + self.feed_forward_norm(self.feed_forward(m)), None
        y, aux = self.feed_forward(
            m,
            document_ids=document_ids,
            pools=pools,
            loss_div_factor=loss_div_factor,
            lb_groups=lb_groups,
            layout=layout,
        )
        return h + self.feed_forward_norm(y), aux
