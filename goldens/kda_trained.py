"""Trained keys: the inputs of a KDA layer's kernel (q, k after l2norm, v, g after the gate, beta)
in a model OLMo-core trained on the project's corpus, for the inverse stability tests.

Until the replay's golden trace exists, this trains its own model on CPU: OLMo-core's v1
`Transformer` with two blocks of the micro config's KDA (2 heads, d_k 32, d_v 64, allow_neg_eigval,
conv 4) and a dense SwiGLU feed-forward (the micro model's MoE blocks need CPU stand-ins that
arrive with the model issue), on OLMo-core's own loader over the corpus (micro config's batches:
8 x 256 tokens, data seed), AdamW (lr 3e-3; the micro recipe's betas 0.9/0.95, wd 0.1, clip 1.0)
for `STEPS` steps. The kernel inputs of the last block in the last step are kept (2 rows), with the
loss of every step. Training is chaotic, so the same run from initial weights moved by one ulp
gives each tensor's own spread ("spread.<name>"), the envelope goldens-check holds a regenerated
file to.
"""

from __future__ import annotations

import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from goldens.data import olmo_core_loader, write_token_files
from goldens.envelope import norm_gap
from goldens.runtime.models import EXPERIMENTAL_KERNELS_OFF, kda_config, rms_norm_config
from goldens.runtime.standins import SUBSTITUTIONS, install, kda_gate, l2_normalize
from goldens.store import GoldenFile
from goldens.tolerances import REGENERATE_TRAINED_KEYS
from goldens.trace import perturb_one_ulp
from model.config import micro

SEED = 5005
PERTURBED_SEED = 1
"""The one-ulp perturbation of the run that records the keys' own spread."""
STEPS = 300
LR = 3e-3
ROWS = 2


def _model():
    from olmo_core.nn.feed_forward import FeedForwardConfig
    from olmo_core.nn.lm_head import LMHeadConfig
    from olmo_core.nn.transformer import TransformerBlockConfig, TransformerConfig

    model = micro().model
    norm = rms_norm_config(model.norm_eps)
    mixer = kda_config(model.kda)
    block = TransformerBlockConfig(
        sequence_mixer=mixer,
        layer_norm=norm,
        name="reordered_norm",
        feed_forward=FeedForwardConfig(hidden_size=4 * model.d_model, bias=False),
    )
    return TransformerConfig(
        d_model=model.d_model,
        vocab_size=model.vocab_size,
        n_layers=2,
        block=block,
        lm_head=LMHeadConfig(layer_norm=norm, bias=False),
        init_seed=SEED,
    )


@contextmanager
def _capturing_kernel_inputs() -> Iterator[dict]:
    """Record what the KDA kernel stand-in computes on, at every call (the last call wins)."""
    kda_ops = sys.modules["fla.ops.kda"]
    chunk_kda = kda_ops.chunk_kda
    into: dict = {}

    def recording(q, k, v, g, beta, A_log=None, dt_bias=None, **kwargs):
        into.update(
            q=l2_normalize(q), k=l2_normalize(k), v=v, g=kda_gate(g, A_log, dt_bias), beta=beta
        )
        return chunk_kda(q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, **kwargs)

    kda_ops.chunk_kda = recording
    try:
        yield into
    finally:
        kda_ops.chunk_kda = chunk_kda


def _train(perturb_seed: int | None = None) -> dict[str, np.ndarray]:
    """The last block's kernel inputs after `STEPS` steps ([ROWS, ...] each) and the loss of every
    step; with `perturb_seed`, from initial weights moved by one ulp (goldens.trace)."""
    import torch
    from olmo_core.data.utils import get_labels
    from olmo_core.optim import AdamWConfig

    config = micro()
    train = config.train
    model = _model().build(init_device="cpu")
    model.init_weights(max_seq_len=train.seq_len, device=torch.device("cpu"))
    if perturb_seed is not None:
        perturb_one_ulp(model, perturb_seed)
    optim = AdamWConfig(lr=LR, betas=train.betas, weight_decay=train.weight_decay).build(model)
    losses = []
    with (
        tempfile.TemporaryDirectory(prefix="goldens-kda-trained-") as tmp,
        _capturing_kernel_inputs() as kernel_inputs,
    ):
        token_files = list(write_token_files(config, Path(tmp)).values())
        loader = olmo_core_loader(config, token_files, Path(tmp, "work"))
        for _, batch in zip(range(STEPS), loader, strict=False):
            out = model(batch["input_ids"], labels=get_labels(batch))
            out.loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), train.max_grad_norm)
            optim.step()
            optim.zero_grad(set_to_none=True)
            losses.append(float(out.loss.detach()))
    tensors = {k: v[:ROWS].detach().numpy().copy() for k, v in kernel_inputs.items()}
    return {**tensors, "loss": np.array(losses, np.float64)}


def export() -> list[GoldenFile]:
    install()
    config = micro()
    model_config = _model()
    tensors = _train()
    perturbed = _train(PERTURBED_SEED)
    spreads = {f"spread.{k}": np.array(norm_gap(perturbed[k], v)) for k, v in tensors.items()}
    return [
        GoldenFile(
            path="kda_trained_keys.safetensors",
            tensors={**tensors, **spreads},
            producer="olmo_core.nn.transformer.Transformer (KDA blocks) trained by a torch loop; "
            "inputs of olmo_core.nn.attention.kda's chunk_kda in its last block",
            seeds={"init": SEED, "data": config.train.data_seed},
            config={
                "model": model_config.as_config_dict(),
                "steps": STEPS,
                "optimizer": {
                    "name": "AdamW",
                    "lr": LR,
                    "betas": list(config.train.betas),
                    "weight_decay": config.train.weight_decay,
                    "max_grad_norm": config.train.max_grad_norm,
                },
                "batch": [config.train.global_batch_size, config.train.seq_len],
                "loss": "the training loss of every step",
                "spread": "spread.<name>: |perturbed - golden| / |golden| of the same training "
                f"from initial weights moved by one ulp (seed {PERTURBED_SEED}, goldens.trace)",
            },
            tolerances={"regenerate": REGENERATE_TRAINED_KEYS.as_dict()},
            substitutions=[*SUBSTITUTIONS, EXPERIMENTAL_KERNELS_OFF],
        )
    ]
