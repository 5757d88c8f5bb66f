"""Golden of OLMo-core's `cross_entropy_loss` (olmo_core/nn/functional/cross_entropy_loss.py),
fp32: logits [2, 32, 384] (the micro vocab) at trained-like scale, labels with ignored (-100)
positions, reduction "sum" with the z-loss (multiplier 1, so `z` is the sum of logsumexp^2), and
the gradient of ce + 1e-5 z with respect to the logits."""

from goldens.store import GoldenFile
from goldens.tolerances import FP32_FORWARD, FP32_GRAD, REGENERATE_COMPONENT
from model.config import micro
from model.data import IGNORE_INDEX

SEED = 7007
SHAPE = (2, 32)
Z_WEIGHT = micro().train.z_loss_weight


def export() -> list[GoldenFile]:
    import torch
    from olmo_core.nn.functional.cross_entropy_loss import cross_entropy_loss

    generator = torch.Generator().manual_seed(SEED)
    vocab = micro().model.vocab_size
    logits = (4 * torch.randn(*SHAPE, vocab, generator=generator)).requires_grad_(True)
    labels = torch.randint(0, vocab, SHAPE, generator=generator)
    labels[:, -1] = IGNORE_INDEX  # OLMo-core's shifted labels
    labels[0, 5:9] = IGNORE_INDEX
    ce, z = cross_entropy_loss(
        logits.view(-1, vocab),
        labels.view(-1),
        reduction="sum",
        compute_z_loss=True,
        z_loss_multiplier=1.0,
    )
    (ce + Z_WEIGHT * z).backward()
    tensors = {"logits": logits, "labels": labels, "ce": ce, "z": z, "grad.logits": logits.grad}
    return [
        GoldenFile(
            path="loss.safetensors",
            tensors={k: v.detach().numpy().copy() for k, v in tensors.items()},
            producer="olmo_core.nn.functional.cross_entropy_loss.cross_entropy_loss",
            seeds={"torch": SEED},
            config={
                "reduction": "sum",
                "z_loss_multiplier": 1.0,
                "grad_of": f"ce + {Z_WEIGHT} z",
                "ignore_index": IGNORE_INDEX,
            },
            tolerances={
                "forward": FP32_FORWARD.as_dict(),
                "grad": FP32_GRAD.as_dict(),
                "regenerate": REGENERATE_COMPONENT.as_dict(),
            },
        )
    ]
