"""fp64 oracles: OLMo-core's own micro model run in float64 on this CPU, beside the same run in
float32, at OLMo-core's initial weights (the trace's step 0, its "normal" init) and at trained ones
(the trace's step 50).

Formula parity holds JAX float64 to the float64 run (a missing term or a misplaced eps shows
whatever the weights); rounding parity holds JAX float32 to it within a small multiple of OLMo-core
float32's own distance ("fp32_error.<name>": |float32 - float64| / |float64| of that tensor, by
norms; the largest over its run and four runs from weights moved by one ulp), which replaces any
absolute floor and holds at random init.

Where OLMo-core or a stand-in computes in float32 on purpose (`.float()` for bf16 inputs), the
float64 run is kept float64 there by `goldens.runtime.standins.float64_patches`, listed in each
manifest entry.

Files `oracle/<case>_<weights>.safetensors`, `weights` in `WEIGHTS`:
- `model`: the whole model's training forward and backward (goldens.model: logits, CE, z-loss,
  per-layer LB, router z and counts, every gradient) and the evaluation logits ("eval.logits"),
  on goldens.model's batch.
- `block_<kind>` (goldens.blocks' three blocks): on the block's input in the float64 training
  forward rounded to float32 (row 0), a token-mean cotangent: y and the gradients w.r.t. x and
  every block parameter.
- `mixer_<kind>` for the KDA block 1 and attention block 7: the sequence mixer alone on its input in
  that forward ("x"), y and the gradients w.r.t. x and the mixer's parameters.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from goldens.blocks import BLOCKS, block_vjp, forward_inputs, loss_div_factor
from goldens.envelope import norm_gap
from goldens.model import STANDINS, batch, eval_logits, prepared_model, train_forward
from goldens.runtime.standins import FLOAT64_PATCHES, float64_patches
from goldens.runtime.torch_layers import to_numpy, token_mean_cotangent
from goldens.store import GoldenFile
from goldens.tolerances import REGENERATE_ORACLE
from goldens.trace import perturb_one_ulp

WEIGHTS = {"init": "trace/params_step0.safetensors", "trained": "trace/params_step50.safetensors"}
"""Weights name -> the golden holding OLMo-core's state dict."""
MIXERS = {kind: BLOCKS[kind] for kind in ("kda", "attention")}
"""The blocks whose sequence mixer has its own case: KDA block 1, attention block 7."""
SEED = 8010
"""The cotangents' generator."""
PERTURBED_SEEDS = (1, 2, 3, 4)
"""One-ulp perturbations of the weights whose float32 runs join the float32 error's estimate: a
single run's distance to the oracle scatters (a cancelling sum such as a KDA A_log gradient came
out 12x farther on another CPU)."""
EXACT = ("input_ids", "labels", "pool_draws", "counts")
"""Outputs that are integers: the same in both runs, kept as they are."""


def fp64_with_error(run: Callable[[object, int | None], dict]) -> dict[str, np.ndarray]:
    """`run(dtype, perturb_seed)` -> named torch tensors of the model `olmo_core(.., dtype,
    perturb_seed)`. Returns the float64 values (patched run), the integer ones, and for each float
    tensor "fp32_error.<name>": the largest distance to them of the float32 run and of the float32
    runs from weights moved by one ulp (`PERTURBED_SEEDS`)."""
    import torch

    f32 = to_numpy(run(torch.float32, None))
    nearby = [to_numpy(run(torch.float32, seed)) for seed in PERTURBED_SEEDS]
    with float64_patches():
        f64 = to_numpy(run(torch.float64, None))
    out = {}
    for name, value in f64.items():
        if name in EXACT:
            if not np.array_equal(value, f32[name]):
                raise AssertionError(f"oracle: {name} differs between float32 and float64")
            out[name] = value
            continue
        if value.dtype != np.float64:
            raise AssertionError(f"oracle: {name} came out {value.dtype} in the float64 run")
        out[name] = value
        errors = [norm_gap(run32[name], value) for run32 in (f32, *nearby)]
        out[f"fp32_error.{name}"] = np.array(max(errors))
    return out


def olmo_core(weights: str, dtype, perturb_seed: int | None):
    """goldens.model's OLMo-core model with the weights of golden `weights` in `dtype`, each weight
    moved by one ulp (goldens.trace) when `perturb_seed` is given."""
    model = prepared_model(weights, dtype)
    if perturb_seed is not None:
        perturb_one_ulp(model, perturb_seed)
    return model


def _model_case(weights: str) -> dict[str, np.ndarray]:
    import torch

    ids, labels = (torch.from_numpy(a) for a in batch())

    def run(dtype, perturb_seed):
        model = olmo_core(weights, dtype, perturb_seed)
        train = train_forward(model, ids, labels)
        return train | {"eval.logits": eval_logits(model, ids)}

    return fp64_with_error(run)


def _block_cases(weights: str) -> dict[str, tuple[dict[str, np.ndarray], dict]]:
    """Every block and mixer case at `weights` on the inputs of the float64 training forward,
    rounded to float32 (so that they do not carry one CPU's float32 rounding): {case: (tensors,
    config)}."""
    import torch

    ids = torch.from_numpy(batch()[0][:1])
    with float64_patches():
        model = prepared_model(weights, torch.float64)
        blocks = {("block", i): model.blocks[str(i)] for i in BLOCKS.values()}
        mixers = {("mixer", i): model.blocks[str(i)].attention for i in MIXERS.values()}
        inputs = forward_inputs(model, ids, blocks | mixers)
    inputs = {key: x.to(torch.float32) for key, x in inputs.items()}
    generator = torch.Generator().manual_seed(SEED)
    cases = {}
    for kind, index in BLOCKS.items():
        x = inputs["block", index]
        cotangent = token_mean_cotangent(x.shape, generator)

        def run(dtype, perturb_seed, index=index, x=x, cotangent=cotangent):
            m = olmo_core(weights, dtype, perturb_seed)
            return block_vjp(m, index, x.to(dtype), ids, cotangent.to(dtype))

        given = {"x": x.numpy(), "cotangent": cotangent.numpy(), "input_ids": ids.numpy()}
        config = {"index": index, "loss_div_factor": loss_div_factor(model.blocks[str(index)], ids)}
        cases[f"block_{kind}"] = (given | fp64_with_error(run), config)
    for kind, index in MIXERS.items():
        x = inputs["mixer", index]
        cotangent = token_mean_cotangent(x.shape, generator)

        def run(dtype, perturb_seed, index=index, x=x, cotangent=cotangent):
            mixer = olmo_core(weights, dtype, perturb_seed).blocks[str(index)].attention
            leaf = x.to(dtype).clone().requires_grad_(True)
            y = mixer(leaf)
            (y * cotangent.to(dtype)).sum().backward()
            grads = {f"grad.{n}": p.grad for n, p in mixer.named_parameters()}
            return {"y": y, "grad.x": leaf.grad, **grads}

        given = {"x": x.numpy(), "cotangent": cotangent.numpy()}
        cases[f"mixer_{kind}"] = (given | fp64_with_error(run), {"index": index})
    return cases


def export() -> list[GoldenFile]:
    files = []
    for weights, path in WEIGHTS.items():
        cases = {"model": (_model_case(path), {}), **_block_cases(path)}
        for case, (tensors, config) in cases.items():
            files.append(
                GoldenFile(
                    path=f"oracle/{case}_{weights}.safetensors",
                    tensors=tensors,
                    producer="olmo_core.nn.ddp.model.OLMoDDPModel (goldens.model.prepared_model) "
                    "in float64 and float32",
                    seeds={"torch_cotangent": SEED},
                    config={
                        **config,
                        "weights": path,
                        "case": case,
                        "dtypes": "values float64; fp32_error.<name> of the float32 run",
                    },
                    tolerances={"regenerate": REGENERATE_ORACLE.as_dict()},
                    substitutions=[*STANDINS, *FLOAT64_PATCHES],
                )
            )
    return files
