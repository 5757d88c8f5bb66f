"""CPU stand-ins for the GPU-only FLA kernels that OLMo-core's `KimiDeltaAttention` calls.

fla-core 0.6.0 installs on a CPU-only machine, but every module that OLMo-core imports from it
(`fla.modules`, `fla.modules.convolution`, `fla.ops.kda`) imports triton, and OLMo-core's
`has_fla()` is False without triton. `install()` registers torch implementations under those
module names and makes `has_fla()` true; FLA's own pure-torch reference `fla/ops/kda/naive.py`
(no triton) is loaded by path and does the recurrence. `SUBSTITUTIONS` is what the manifest
records. Each stand-in is tested in tests/test_cpu_standins.py.
"""

from __future__ import annotations

import importlib.util
import itertools
import sys
import types
from pathlib import Path

import torch
import torch.nn.functional as F

L2_NORM_EPS = 1e-6  # FLA l2norm: x * rsqrt(sum(x^2) + eps)

SUBSTITUTIONS = [
    "fla.ops.kda.chunk_kda (triton) -> FLA's fla/ops/kda/naive.py naive_recurrent_kda, per "
    "document of cu_seqlens, after the in-kernel l2norm (eps 1e-6) and gate "
    "(-exp(A_log) * softplus(g + dt_bias)) written as torch ops",
    "fla.modules.FusedRMSNormGated (triton) -> torch: x * rsqrt(mean(x^2) + eps) * weight * "
    "act(g), fp32",
    "fla.modules.convolution.causal_conv1d (triton) -> torch F.conv1d, depthwise, left padding "
    "W - 1, per document of cu_seqlens, then the activation",
    "olmo_core.nn.attention.{flash_linear_attn_api,kda}.has_fla -> True",
]


def fla_naive() -> types.ModuleType:
    """FLA's `fla/ops/kda/naive.py`, loaded by path (its package __init__ imports triton)."""
    name = "fla_kda_naive"
    if name not in sys.modules:
        spec = importlib.util.find_spec("fla")
        path = Path(spec.origin).parent / "ops" / "kda" / "naive.py"
        module_spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(module_spec)
        module_spec.loader.exec_module(module)
        sys.modules[name] = module
    return sys.modules[name]


def _fp32(x: torch.Tensor) -> torch.Tensor:
    """At least float32 (float64 stays, for gradcheck)."""
    return x if x.dtype == torch.float64 else x.float()


def _activation(x: torch.Tensor, name: str | None) -> torch.Tensor:
    if name is None:
        return x
    if name in ("silu", "swish"):
        return F.silu(x)
    if name == "sigmoid":
        return torch.sigmoid(x)
    raise NotImplementedError(name)


def _documents(T: int, cu_seqlens: torch.Tensor | None) -> list[tuple[int, int]]:
    bounds = [0, T] if cu_seqlens is None else cu_seqlens.tolist()
    return list(itertools.pairwise(bounds))


class FusedRMSNormGated(torch.nn.Module):
    """FLA's `FusedRMSNormGated` (fla/modules/norm/fused_norm_gate.py): same constructor, same
    `weight`, no bias; y = x * rsqrt(mean(x^2) + eps) * weight * act(g), computed in fp32."""

    def __init__(
        self,
        hidden_size,
        elementwise_affine=True,
        eps=1e-5,
        activation="swish",
        device=None,
        dtype=None,
    ):
        super().__init__()
        if not elementwise_affine:
            raise NotImplementedError("elementwise_affine=False")
        self.hidden_size, self.eps, self.activation = hidden_size, eps, activation
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))
        self.register_parameter("bias", None)

    def reset_parameters(self):
        torch.nn.init.ones_(self.weight)

    def forward(self, x, g, residual=None, prenorm=False, residual_in_fp32=False):
        if residual is not None or prenorm:
            raise NotImplementedError("residual / prenorm")
        x32 = _fp32(x)
        y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps) * _fp32(self.weight)
        return (y * _activation(_fp32(g), self.activation)).to(x.dtype)


def causal_conv1d(x, weight, bias=None, activation=None, backend=None, cu_seqlens=None, **_):
    """FLA's `causal_conv1d`: x [B, T, C], weight [C, W]; returns (y [B, T, C], None)."""
    B, T, C = x.shape
    W = weight.shape[-1]
    if cu_seqlens is not None and B != 1:
        raise ValueError("cu_seqlens needs B == 1")
    pieces = []
    for start, end in _documents(T, cu_seqlens):
        doc = x[:, start:end].transpose(1, 2)  # shape: [B, C, t]
        y = F.conv1d(doc, weight.unsqueeze(1), bias, padding=W - 1, groups=C)[..., : end - start]
        pieces.append(y.transpose(1, 2))
    return _activation(torch.cat(pieces, 1), activation), None


def l2_normalize(x: torch.Tensor) -> torch.Tensor:
    """FLA's in-kernel `l2norm`: x * rsqrt(sum(x^2) + 1e-6), in (at least) fp32."""
    x = _fp32(x)
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + L2_NORM_EPS)


def kda_gate(raw: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor) -> torch.Tensor:
    """FLA's in-kernel gate: -exp(A_log[h]) * softplus(raw + dt_bias), raw [..., H, K]."""
    H = raw.shape[-2]
    return -_fp32(a_log).exp()[:, None] * F.softplus(_fp32(raw) + _fp32(dt_bias).view(H, -1))


def chunk_kda(
    q,
    k,
    v,
    g,
    beta,
    scale=None,
    initial_state=None,
    output_final_state=False,
    use_qk_l2norm_in_kernel=False,
    use_gate_in_kernel=False,
    A_log=None,
    dt_bias=None,
    cu_seqlens=None,
    **_,
):
    """FLA's `chunk_kda` as OLMo-core calls it, through `naive_recurrent_kda` (which computes
    in fp32; its backward is torch autograd through FLA's reference)."""
    if use_qk_l2norm_in_kernel:
        q, k = l2_normalize(q), l2_normalize(k)
    if use_gate_in_kernel:
        g = kda_gate(g, A_log, dt_bias)
    naive = fla_naive()
    outputs, states = [], []
    for i, (start, end) in enumerate(_documents(q.shape[1], cu_seqlens)):
        # with cu_seqlens, initial_state has one row per document
        state0 = (
            initial_state
            if cu_seqlens is None or initial_state is None
            else initial_state[i : i + 1]
        )
        o, state = naive.naive_recurrent_kda(
            q[:, start:end],
            k[:, start:end],
            v[:, start:end],
            g[:, start:end],
            beta[:, start:end],
            scale=scale,
            initial_state=state0,
            output_final_state=output_final_state,
        )
        outputs.append(o)
        states.append(state)
    final = torch.cat(states, 0) if output_final_state else None
    return torch.cat(outputs, 1), final


def install() -> None:
    """Register the stand-ins under FLA's module names and make OLMo-core see FLA."""
    modules = {
        "fla.modules": {"FusedRMSNormGated": FusedRMSNormGated},
        "fla.modules.convolution": {"causal_conv1d": causal_conv1d},
        "fla.ops": {},
        "fla.ops.kda": {"chunk_kda": chunk_kda},
    }
    for name, attributes in modules.items():
        module = types.ModuleType(name, f"olmo-parity CPU stand-in for {name}")
        module.__dict__.update(attributes)
        sys.modules[name] = module
    from olmo_core.nn.attention import flash_linear_attn_api, kda

    flash_linear_attn_api.has_fla = kda.has_fla = lambda: True
