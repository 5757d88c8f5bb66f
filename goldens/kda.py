"""Goldens of Kimi Delta Attention, fp32, the micro config's KDA shape (2 heads, d_k 32, d_v 64).

- `kda_layer.safetensors`: OLMo-core's `KimiDeltaAttention` (d_model 64, allow_neg_eigval, conv 4
  without bias), run on CPU with the stand-ins of `goldens.cpu_standins`; input x [2, 256, 64]
  (4 chunks), its weights (OLMo-core names), output y, and the gradients of sum(y * cotangent)
  (cotangent N(0, 1 / (B*T))) with respect to x and every weight. Weights are drawn at
  trained-like scale (linear std 1/sqrt(fan_in)) rather than at init (std 0.02), so that no
  part of the layer is negligible.
- `kda_chunk.safetensors`: FLA's references on kernel inputs (q, k L2-normed, g from the gate,
  beta = 2 sigmoid): `naive_chunk_kda` at T = 256 with its chunk tensors A (strictly lower,
  beta-scaled) and (I + A)^-1 diag(beta), captured from inside it, its output and final
  state (forward only: its backward is NaN); `naive_recurrent_kda` at T = 256 with the gradients
  of sum(o * do) + sum(S * dS), and at T = 1024 (16 chunks) forward.
"""

from __future__ import annotations

import linecache
import sys

from goldens.cpu_standins import SUBSTITUTIONS, fla_naive, install
from goldens.olmo_core_model import EXPERIMENTAL_KERNELS_OFF, kda_config
from goldens.store import GoldenFile
from goldens.tolerances import KDA_FORWARD, KDA_GRAD, REGENERATE_COMPONENT
from goldens.torch_layers import layer_vjp, to_numpy
from model.config import micro

SEED = 4004
KDA = micro().model.kda
D_MODEL, N_HEADS, HEAD_DIM, EXPAND_V = (
    micro().model.d_model,
    KDA.n_heads,
    KDA.head_dim,
    KDA.expand_v,
)
LAYER_SHAPE = (2, 256)  # [B, T] of the layer input
CHUNK_T, LONG_T = 256, 1024
TOLERANCES = {
    "forward": KDA_FORWARD.as_dict(),
    "grad": KDA_GRAD.as_dict(),
    "regenerate": REGENERATE_COMPONENT.as_dict(),
}


def _layer(generator):
    import torch

    config = kda_config(KDA)
    layer = config.build(D_MODEL, layer_idx=0, n_layers=1)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if name == "A_log":
                p.copy_(torch.empty_like(p).uniform_(1, 16, generator=generator).log())
            elif name == "dt_bias" or name.endswith("bias"):
                p.copy_(0.5 * torch.randn(p.shape, generator=generator))
            elif name == "o_norm.weight":
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=generator))
            else:  # linear [out, in] or conv [C, 1, W]
                p.copy_(torch.randn(p.shape, generator=generator) / p.shape[-1] ** 0.5)
    return config, layer


def export_layer(generator) -> GoldenFile:
    import torch

    config, layer = _layer(generator)
    x = torch.randn(*LAYER_SHAPE, D_MODEL, generator=generator, requires_grad=True)
    return GoldenFile(
        path="kda_layer.safetensors",
        tensors=to_numpy(layer_vjp(layer, x, generator)),
        producer="olmo_core.nn.attention.kda.KimiDeltaAttention",
        seeds={"torch": SEED},
        config={
            "kda": config.as_dict(),
            "d_model": D_MODEL,
            "x_shape": [*LAYER_SHAPE, D_MODEL],
            "weights": "linear/conv N(0, 1/fan_in); A_log log U(1,16); biases N(0, 0.25); "
            "o_norm 1 + N(0, 0.01)",
        },
        tolerances=TOLERANCES,
        substitutions=[*SUBSTITUTIONS, EXPERIMENTAL_KERNELS_OFF],
    )


def _kernel_inputs(generator, T):
    import torch
    import torch.nn.functional as F

    B, H, K, V = 1, N_HEADS, HEAD_DIM, int(HEAD_DIM * EXPAND_V)
    q, k = (F.normalize(torch.randn(B, T, H, K, generator=generator), dim=-1) for _ in range(2))
    v = torch.randn(B, T, H, V, generator=generator)
    a_log = torch.empty(H).uniform_(1, 16, generator=generator).log()
    raw = torch.randn(B, T, H, K, generator=generator) - 3.0  # weak decay, as trained gates
    g = -a_log.exp()[:, None] * F.softplus(raw)
    beta = 2 * torch.sigmoid(torch.randn(B, T, H, generator=generator))
    state = torch.randn(B, H, K, V, generator=generator)
    return {"q": q, "k": k, "v": v, "g": g, "beta": beta, "initial_state": state}


def _naive_chunk_with_internals(inputs):
    """Run FLA's `naive_chunk_kda`, capturing its A before and after the inversion."""
    naive = fla_naive()
    code, captured = naive.naive_chunk_kda.__code__, {}

    def local(frame, event, arg):
        line = linecache.getline(frame.f_code.co_filename, frame.f_lineno).strip()
        if event == "line" and line.startswith("for i in range(1, BT)") and "A" not in captured:
            captured["A"] = -frame.f_locals["A"].clone()  # undo `A = -A.masked_fill(mask, 0)`
        if event == "return":
            captured["T_beta"] = frame.f_locals["A"].clone()  # (A + I) * beta after the inversion
        return local

    sys.settrace(lambda frame, event, arg: local if frame.f_code is code else None)
    try:
        o, state = naive.naive_chunk_kda(**inputs, output_final_state=True)
    finally:
        sys.settrace(None)
    return {"o": o, "final_state": state, **captured}


def export_chunk(generator) -> GoldenFile:
    import torch

    naive = fla_naive()
    tensors = {}
    chunk_inputs = _kernel_inputs(generator, CHUNK_T)
    tensors.update({f"chunk.{k}": v for k, v in chunk_inputs.items()})
    tensors.update({f"chunk.{k}": v for k, v in _naive_chunk_with_internals(chunk_inputs).items()})

    leaves = {k: v.clone().requires_grad_(True) for k, v in chunk_inputs.items()}
    o, state = naive.naive_recurrent_kda(**leaves, output_final_state=True)
    do, dstate = (
        torch.randn(o.shape, generator=generator),
        torch.randn(state.shape, generator=generator),
    )
    ((o * do).sum() + (state * dstate).sum()).backward()
    tensors.update(
        {
            "recurrent.o": o,
            "recurrent.final_state": state,
            "recurrent.do": do,
            "recurrent.dstate": dstate,
        }
    )
    tensors.update({f"recurrent.grad.{k}": v.grad for k, v in leaves.items()})

    long_inputs = _kernel_inputs(generator, LONG_T)
    o, state = naive.naive_recurrent_kda(**long_inputs, output_final_state=True)
    tensors.update({f"long.{k}": v for k, v in long_inputs.items()})
    tensors.update({"long.o": o, "long.final_state": state})
    return GoldenFile(
        path="kda_chunk.safetensors",
        tensors=to_numpy(tensors),
        producer="fla.ops.kda.naive (naive_chunk_kda, naive_recurrent_kda), fla-core 0.6.0",
        seeds={"torch": SEED + 1},
        config={
            "H": N_HEADS,
            "K": HEAD_DIM,
            "V": int(HEAD_DIM * EXPAND_V),
            "chunk_size": 64,
            "T": {"chunk": CHUNK_T, "recurrent": CHUNK_T, "long": LONG_T},
            "layouts": {"chunk.A, chunk.T_beta": "[B, H, N, C, C]"},
        },
        tolerances=TOLERANCES,
        substitutions=["FLA's pure-torch references only; no triton kernel involved"],
    )


def export() -> list[GoldenFile]:
    import torch

    install()
    return [
        export_layer(torch.Generator().manual_seed(SEED)),
        export_chunk(torch.Generator().manual_seed(SEED + 1)),
    ]
