"""The olmo35 hybrid language model, as OLMo-core's `OLMoDDPModel` (olmo_core/nn/ddp/model.py,
nn/lm_head.py, 3.0.0) with peri-norm blocks (`model.block`):

    h = embedding_norm(embeddings[input_ids] * sqrt(d_model))      (scale first, then norm)
    h, aux_l = block_l(h)                                          (l = 0 .. n_layers - 1)
    logits = lm_head.norm(h) @ w_out                               (untied)

EMO document ids come from EOS (`model.router.document_ids_from_eos`) unless given. Pool sizes
are an explicit input in training: `pool_draws` [n_moe_layers, B, T] (OLMo-core's `torch.randint`
tensor of each MoE layer, in layer order) or `pool_key` (a JAX key, one draw per MoE layer); in
evaluation every document has the eval pool. The per-layer router losses (unweighted, divided by
`loss_div_factor`) and expert counts come back stacked over the MoE layers; OLMo-core attaches the
weighted ones to the graph instead, so a trainer adds them to its objective itself.

At scale (`model.layout`) the hidden state is laid out [batch, length, embed] between blocks,
and each block may be rematerialised (`ScaleConfig.remat_policy`, `CHECKPOINT_POLICIES`).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from model.block import Block
from model.config import Flags, ModelConfig
from model.init import linear, trunc_normal
from model.layout import Layout
from model.loss import lm_head_loss_sums
from model.moe import MoEAux
from model.norms import RMSNorm
from model.precision import compute_dtype, full_precision
from model.router import document_ids_from_eos, draw_pools

CHECKPOINT_POLICIES = {"full": None, "save_matmuls": jax.checkpoint_policies.dots_saveable}
"""`jax.checkpoint` policy of each `ScaleConfig.remat_policy` but "none": "full" saves nothing
inside a block, "save_matmuls" every matmul output."""
ACTIVATION = ("batch", "length", "embed")
"""Logical axes of a hidden state [B, T, d_model]."""


def run_block(block: Block, h: jax.Array, *, remat: str, **kwargs):
    """`block(h, **kwargs)`, rematerialised in the backward pass as `remat` says."""
    if remat == "none":
        return block(h, **kwargs)
    graphdef, state = nnx.split(block)
    forward = lambda state, h: nnx.merge(graphdef, state)(h, **kwargs)  # noqa: E731
    return jax.checkpoint(forward, policy=CHECKPOINT_POLICIES[remat])(state, h)


class ModelOutput(NamedTuple):
    logits: jax.Array
    """[B, T, V] in the compute dtype (`ModelConfig.compute_dtype`)."""
    aux: MoEAux
    """lb_loss, z_loss [n_moe_layers]; counts [n_moe_layers, E]."""


class LMHead(nnx.Module):
    """RMSNorm then the untied output projection; `w_out` is a linear kernel [d_model, V]."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        d, V = config.d_model, config.vocab_size
        self.dtype = compute_dtype(config.compute_dtype)
        self.norm = RMSNorm(d, eps=config.norm_eps, dtype=self.dtype)
        self.w_out = linear(d, V, config.init_std, rngs, axes=("embed", "vocab"), dtype=self.dtype)

    def __call__(self, h: jax.Array) -> jax.Array:
        return self.w_out(self.norm(h))

    def loss_sums(
        self,
        h: jax.Array,
        labels: jax.Array,
        *,
        tiles: int,
        seq_major: bool,
        layout: Layout | None = None,
        keep_logits: bool = False,
    ) -> tuple[jax.Array, jax.Array]:
        """The CE and z-loss sums over the labels not ignored of hidden states h [B, T, d_model]
        and labels [B, T], the logits made a vocab tile at a time (`model.loss.lm_head_loss_sums`;
        OLMo-core's `LMHead` with its fused loss); the projection in the compute dtype."""
        return lm_head_loss_sums(
            self.norm(h),
            self.w_out.kernel[...].astype(self.dtype),
            labels,
            tiles=tiles,
            seq_major=seq_major,
            layout=layout,
            keep_logits=keep_logits,
        )


class Transformer(nnx.Module):
    """`m(input_ids [B, T], train=..., ...)` -> `ModelOutput`. `ignore_segment_ids` is
    `Flags.olmoe3_mixers_ignore_segment_ids`, `kda_inverse` `Flags.kda_inverse`. Init as
    OLMo-core's "normal" method: weights N(0, init_std) truncated at 3 std, norm gains one, KDA's
    A_log and dt_bias as OLMo-core's KDA (`tests/test_convert.py` compares the distributions).
    Activations are in `config.compute_dtype`, params in its full precision (`model.precision`);
    "float64" needs `jax_enable_x64` and raises a ValueError saying how without it."""

    def __init__(
        self, config: ModelConfig, *, ignore_segment_ids: bool, kda_inverse: str, rngs: nnx.Rngs
    ):
        self.config = config
        d = config.d_model
        self.dtype = compute_dtype(config.compute_dtype)
        self.embeddings = nnx.Param(
            trunc_normal(config.init_std)(
                rngs.params(), (config.vocab_size, d), full_precision(self.dtype)
            ),
            logical_axes=("vocab", "embed"),
        )
        self.embedding_norm = RMSNorm(d, eps=config.norm_eps, dtype=self.dtype)
        self.blocks = nnx.List(
            [
                Block(
                    config,
                    i,
                    ignore_segment_ids=ignore_segment_ids,
                    kda_inverse=kda_inverse,
                    rngs=rngs,
                )
                for i in range(config.n_layers)
            ]
        )
        self.lm_head = LMHead(config, rngs=rngs)

    @classmethod
    def of(cls, config: ModelConfig, flags: Flags, *, rngs: nnx.Rngs) -> Transformer:
        """The model of `config` with the mixers' switches of `flags`."""
        return cls(
            config,
            ignore_segment_ids=flags.olmoe3_mixers_ignore_segment_ids,
            kda_inverse=flags.kda_inverse,
            rngs=rngs,
        )

    def hidden(
        self,
        input_ids: jax.Array,
        *,
        train: bool = False,
        pool_draws: jax.Array | None = None,
        pool_key: jax.Array | None = None,
        loss_div_factor=None,
        document_ids: jax.Array | None = None,
        lb_groups: int = 1,
        layout: Layout | None = None,
        remat: str = "none",
        kda_kernel: str = "pallas",
        attention_kernel: str = "pallas",
    ) -> tuple[jax.Array, MoEAux]:
        """The final hidden states [B, T, d_model] before the LM head (for a tiled LM loss), and
        the aux of every MoE layer. input_ids [B, T] int. In training (EMO), exactly one of
        `pool_draws` [n_moe_layers, B, T] (document d of row b in layer l uses [l, b, d]) and
        `pool_key`; neither in evaluation. `loss_div_factor`: the aux losses' divisor (None:
        B*T). `document_ids` [B, T] from 0 (None: from EOS, OLMo-core's way). `lb_groups`: as
        `model.moe.router_aux`. `layout`: the mesh the model runs on (`model.layout`; None:
        one device). `remat`: `ScaleConfig.remat_policy`; `kda_kernel`: `ScaleConfig.kda_kernel`;
        `attention_kernel`: `ScaleConfig.attention_kernel`."""
        c = self.config
        pools = self.pool_sizes(
            input_ids.shape, train=train, pool_draws=pool_draws, pool_key=pool_key
        )
        if document_ids is None:
            document_ids = document_ids_from_eos(input_ids, eos_token_id=c.eos_token_id)
        embedded = self.embeddings[...][input_ids].astype(self.dtype)
        constrain = (lambda x: x) if layout is None else (lambda x: layout.constrain(x, ACTIVATION))
        h = constrain(self.embedding_norm(embedded * c.embed_scale))
        auxes = []
        for block in self.blocks:
            layer_pools = None if pools is None else pools[len(auxes)]
            h, aux = run_block(
                block,
                h,
                remat=remat,
                document_ids=document_ids,
                pools=layer_pools,
                loss_div_factor=loss_div_factor,
                lb_groups=lb_groups,
                layout=layout,
                kda_kernel=kda_kernel,
                attention_kernel=attention_kernel,
            )
            h = constrain(h)
            if aux is not None:
                auxes.append(aux)
        return h, MoEAux(*(jnp.stack(parts) for parts in zip(*auxes, strict=True)))

    def __call__(self, input_ids: jax.Array, **kwargs) -> ModelOutput:
        """Logits [B, T, V] and the MoE aux; keyword arguments as `hidden`."""
        h, aux = self.hidden(input_ids, **kwargs)
        return ModelOutput(self.lm_head(h), aux)

    def pool_sizes(self, shape, *, train: bool, pool_draws=None, pool_key=None) -> jax.Array | None:
        """Per-layer per-document pools [n_moe_layers, B, T] for inputs of `shape` [B, T]: the
        given draws, or one `draw_pools` per MoE layer from `pool_key`; None for the eval pool
        (or without EMO)."""
        emo = self.config.moe.emo
        draws, key = pool_draws, pool_key
        given = [name for name, v in (("pool_draws", draws), ("pool_key", key)) if v is not None]
        if emo is None or not train:
            if given:
                raise ValueError(f"{given[0]} given without EMO training (train={train})")
            return None
        if len(given) != 1:
            raise ValueError(f"EMO training needs exactly one of pool_draws, pool_key; got {given}")
        n_moe = len(self.config.moe_layers)
        if key is not None:
            return jnp.stack([draw_pools(k, shape, emo=emo) for k in jax.random.split(key, n_moe)])
        if draws.shape != (n_moe, *shape):
            raise ValueError(f"pool_draws: shape {draws.shape}, expected {(n_moe, *shape)}")
        return draws
