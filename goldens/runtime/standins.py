"""CPU stand-ins for the GPU-only kernels that OLMo-core calls: FLA's in `KimiDeltaAttention`
(`install()`) and the v2 MoE's in `OLMoDDPTransformerBlock` (`install_moe()`).

fla-core 0.6.0 installs on a CPU-only machine, but every module that OLMo-core imports from it
(`fla.modules`, `fla.modules.convolution`, `fla.ops.kda`) imports triton, and OLMo-core's
`has_fla()` is False without triton. `install()` registers torch implementations under those
module names and makes `has_fla()` true; FLA's own pure-torch reference `fla/ops/kda/naive.py`
(no triton) is loaded by path and does the recurrence.

OLMo-core's v2 MoE without expert parallelism (`olmo_core/nn/moe/v2/no_ep.py`) needs CUDA streams,
a device-to-host copy of the expert counts, the `grouped_gemm` package (or torch's grouped_mm with
counts on a GPU) and Transformer Engine's token permute / unpermute. `install_moe()` takes the
host-side-counts path and puts torch code in the place of each.

`SUBSTITUTIONS` and `MOE_SUBSTITUTIONS` are what the manifest records. Each stand-in is tested in
tests/test_cpu_standins.py.
"""

from __future__ import annotations

import importlib.util
import inspect
import itertools
import sys
import types
from collections.abc import Iterator
from contextlib import contextmanager
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


IGNORED_ARGUMENTS = {
    "causal_conv1d": {"backend": "picks FLA's triton or CUDA kernel; one torch conv here"},
    "FusedRMSNormGated.forward": {"residual_in_fp32": "only read with a residual, refused here"},
}
"""Arguments a stand-in accepts and ignores, each shown irrelevant to its result. Any other
argument it does not implement raises `StandInError`."""


class StandInError(NotImplementedError):
    """OLMo-core asked a CPU stand-in for something it does not implement."""


def refuse(stand_in: str, unknown: dict) -> None:
    """Raise `StandInError` naming the keyword arguments in `unknown`, if any."""
    if unknown:
        raise StandInError(
            f"CPU stand-in {stand_in} got {sorted(unknown)}, which it does not implement; "
            "the golden would silently ignore them"
        )


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
    raise StandInError(f"CPU stand-in activation {name!r}")


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
            raise StandInError("CPU stand-in FusedRMSNormGated: elementwise_affine=False")
        self.hidden_size, self.eps, self.activation = hidden_size, eps, activation
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))
        self.register_parameter("bias", None)

    def reset_parameters(self):
        torch.nn.init.ones_(self.weight)

    def forward(self, x, g, residual=None, prenorm=False, residual_in_fp32=False, **unknown):
        refuse("FusedRMSNormGated.forward", unknown)
        if residual is not None or prenorm:
            raise StandInError("CPU stand-in FusedRMSNormGated.forward: residual / prenorm")
        x32 = _fp32(x)
        y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps) * _fp32(self.weight)
        return (y * _activation(_fp32(g), self.activation)).to(x.dtype)


def causal_conv1d(x, weight, bias=None, activation=None, backend=None, cu_seqlens=None, **unknown):
    """FLA's `causal_conv1d`: x [B, T, C], weight [C, W]; returns (y [B, T, C], None)."""
    refuse("causal_conv1d", unknown)
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
    **unknown,
):
    """FLA's `chunk_kda` as OLMo-core calls it, through `naive_recurrent_kda` (which computes
    in fp32; its backward is torch autograd through FLA's reference)."""
    refuse("chunk_kda", unknown)
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


MOE_SUBSTITUTIONS = [
    "olmo_core.nn.moe.v2.routed_experts: USE_TORCH_GROUPED_MM = False and "
    "REQUIRES_HOST_SIDE_SPLIT_SIZES = True (the host-side expert counts path; torch's grouped_mm "
    "path asserts the counts are on a GPU)",
    "grouped_gemm.ops.gmm (CUDA package) -> torch: one matmul per expert over its rows",
    "transformer_engine moe_permute / moe_unpermute (map_type='index') -> torch: rows sorted by "
    "expert (stable, token order within an expert); unpermute = sum over k of prob * row",
    "no_ep.async_copy_to_cpu (CUDA stream + pinned copy) -> a synchronous copy",
    "CUDA streams: OLMoDDPTransformerBlock.get_dense_stream -> None (torch.cuda.stream(None) is a "
    "no-op), no_ep.wait_stream_no_compile -> no-op, torch.cuda.current_stream -> None",
]


def grouped_gemm(a, b, batch_sizes, trans_b=False):
    """`grouped_gemm.ops.gmm`: a [N, K] rows grouped by expert (batch_sizes [E] on the CPU, summing
    to N); b [E, K, M], or [E, M, K] with trans_b. Returns [N, M], row i times its group's b."""
    pieces, start = [], 0
    for e, rows in enumerate(batch_sizes.tolist()):
        w = b[e].transpose(0, 1) if trans_b else b[e]
        pieces.append(a[start : start + rows] @ w)
        start += rows
    return torch.cat(pieces, 0)


def moe_permute(inp, routing_map, num_out_tokens=-1, map_type="index", **unknown):
    """Transformer Engine's `moe_permute` with `map_type="index"`: inp [N, H], routing_map [N, k]
    expert ids -> (rows [N * k, H] sorted by expert, token order within an expert; row_id_map
    [N * k], the flat (token, slot) index of each row)."""
    refuse("moe_permute", unknown)
    if map_type != "index" or num_out_tokens not in (-1, routing_map.numel()):
        raise StandInError(
            f"CPU stand-in moe_permute: map_type={map_type!r}, num_out_tokens={num_out_tokens}"
        )
    k = routing_map.shape[1]
    row_id_map = torch.argsort(routing_map.reshape(-1), stable=True)
    return inp[row_id_map // k], row_id_map


def moe_unpermute(
    inp, row_id_map, merging_probs=None, restore_shape=None, map_type="index", **unknown
):
    """Transformer Engine's `moe_unpermute` with `map_type="index"`: rows [N * k, H] in
    `moe_permute`'s order -> [N, H], each token the sum over its k slots of prob * row, in
    (at least) fp32."""
    refuse("moe_unpermute", unknown)
    if map_type != "index" or merging_probs is None:
        raise StandInError(f"CPU stand-in moe_unpermute: map_type={map_type!r}, merging_probs None")
    N, k = merging_probs.shape
    slots = inp[torch.argsort(row_id_map)].view(N, k, -1)  # shape: [N * k, H] -> [N, k, H]
    out = (_fp32(slots) * _fp32(merging_probs).unsqueeze(-1)).sum(1).to(inp.dtype)
    return out if restore_shape is None else out.view(restore_shape)


class _CopyDone:
    """The event of a copy that has already happened."""

    def synchronize(self) -> None:
        pass


def async_copy_to_cpu(gpu_buf, event=None, return_event=True):
    """`olmo_core.nn.moe.utils.async_copy_to_cpu` on a CPU: a synchronous copy."""
    return gpu_buf.clone(), None, _CopyDone() if return_event else None


def install_moe() -> None:
    """Put the MoE stand-ins in place (see `MOE_SUBSTITUTIONS`)."""
    from olmo_core.nn.ddp.block import OLMoDDPTransformerBlock
    from olmo_core.nn.moe import utils
    from olmo_core.nn.moe.v2 import no_ep, routed_experts

    routed_experts.USE_TORCH_GROUPED_MM = False
    routed_experts.REQUIRES_HOST_SIDE_SPLIT_SIZES = True
    routed_experts.gmm_no_compile = grouped_gemm
    utils.moe_permute, utils.moe_unpermute = moe_permute, moe_unpermute
    no_ep.async_copy_to_cpu = async_copy_to_cpu
    no_ep.wait_stream_no_compile = lambda this_stream, other_stream: None
    OLMoDDPTransformerBlock.get_dense_stream = lambda self, for_x1=False: None
    if not torch.cuda.is_available():
        torch.cuda.current_stream = lambda device=None: None


FLOAT64_PATCHES = [
    "float64 run: torch.Tensor.float() leaves float64 tensors float64 (OLMo-core upcasts to "
    "float32 on purpose for bf16: RMSNorm full_precision x.float() (layer_norm.py:282), the "
    "attention gate's g.float() (attention/__init__.py:1079), KDA's w_b(x).float().sigmoid() "
    "(kda.py:187), the router's x / weight .float() (emo_router.py:85, router.py:491-493), "
    "cross_entropy_loss's logits.float() (functional/cross_entropy_loss.py:35))",
    "float64 run: torch default dtype float64 (scalable softmax's log of int64 lengths "
    "(attention/__init__.py:883) and the router's loss accumulators (router.py:255-301) are "
    "created in the default dtype)",
    "float64 run: FLA naive_recurrent_kda's x.to(torch.float) (fla/ops/kda/naive.py:51) becomes "
    "x.to(promote_types(x.dtype, float32)): the recurrence runs in float64",
]
"""What `float64_patches` changes, for the manifests. Each is a place where OLMo-core computes in
float32 whatever its input (meant for bfloat16 training); the JAX model computes there in
`model.precision.full_precision` of its dtype, which is the same float32 in a float32 run."""


@contextmanager
def float64_patches() -> Iterator[None]:
    """Inside: an OLMo-core model cast to float64 computes in float64 throughout, forward and
    backward (`FLOAT64_PATCHES`); float32 and integer tensors behave as before."""
    to_float = torch.Tensor.float
    default = torch.get_default_dtype()
    naive = fla_naive()
    recurrent = naive.naive_recurrent_kda
    source = inspect.getsource(recurrent)
    upcast = "x.to(torch.promote_types(x.dtype, torch.float))"
    if source.count("x.to(torch.float)") != 1:
        raise StandInError(
            "float64_patches: FLA's naive_recurrent_kda no longer casts with one "
            "`x.to(torch.float)`; update the float64 patch for this fla-core version"
        )
    scope = dict(naive.__dict__)
    exec(compile(source.replace("x.to(torch.float)", upcast), naive.__file__, "exec"), scope)
    torch.Tensor.float = lambda x, *a, **k: x if x.dtype == torch.float64 else to_float(x, *a, **k)
    torch.set_default_dtype(torch.float64)
    naive.naive_recurrent_kda = scope["naive_recurrent_kda"]
    try:
        yield
    finally:
        torch.Tensor.float = to_float
        torch.set_default_dtype(default)
        naive.naive_recurrent_kda = recurrent
