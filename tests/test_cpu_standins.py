"""The exporter's CPU stand-ins (goldens/runtime/standins.py), each against an independent
reference. FLA's kernels: OLMo-core's RMSNorm, torch's Conv1d (which OLMo-core's CausalConv1d
subclasses), FLA's naive_chunk_kda; documents of cu_seqlens isolated. The v2 MoE's: grouped GEMM
against per-row weights, TE permute / unpermute against a loop over tokens. Backward by fp64
gradcheck."""

import pytest
import torch
import torch.nn.functional as F

from goldens.runtime import standins as s
from goldens.tolerances import (
    BITWISE,
    STANDIN_CHUNK_KDA,
    STANDIN_FP32,
    STANDIN_FP64,
    STANDIN_MOE_BLOCK,
)

GEN = 7


def _randn(*shape, dtype=torch.float64):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(GEN), dtype=dtype)


def test_rms_norm_gated_matches_olmo_core_rms_norm():
    from olmo_core.nn.layer_norm import LayerNormConfig, LayerNormType

    x, g = _randn(2, 5, 8, dtype=torch.float32), _randn(2, 5, 8, dtype=torch.float32).flip(0)
    norm = s.FusedRMSNormGated(8, eps=1e-5, activation="sigmoid")
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(0.5, 1.5, 8))
        reference = LayerNormConfig(name=LayerNormType.rms, eps=1e-5, bias=False).build(8)
        reference.weight.copy_(norm.weight)
        torch.testing.assert_close(
            norm(x, g), reference(x) * torch.sigmoid(g), **STANDIN_FP32.as_dict()
        )


def test_rms_norm_gated_gradcheck():
    norm = s.FusedRMSNormGated(8, eps=1e-5, activation="sigmoid").double()
    x, g = _randn(2, 3, 8).requires_grad_(), _randn(2, 3, 8).flip(1).requires_grad_()
    assert torch.autograd.gradcheck(norm, (x, g))


def test_causal_conv1d_matches_torch_conv1d_per_document():
    x, w = _randn(1, 20, 6, dtype=torch.float32), _randn(6, 4, dtype=torch.float32)
    conv = torch.nn.Conv1d(6, 6, 4, groups=6, padding=3, bias=False)
    with torch.no_grad():
        conv.weight.copy_(w[:, None, :])
        whole = F.silu(conv(x.transpose(1, 2))[..., :20].transpose(1, 2))
        y, _ = s.causal_conv1d(x, w, activation="silu")
        torch.testing.assert_close(y, whole, **STANDIN_FP32.as_dict())
        docs, _ = s.causal_conv1d(x, w, activation="silu", cu_seqlens=torch.tensor([0, 7, 20]))
        alone, _ = s.causal_conv1d(x[:, 7:], w, activation="silu")
        torch.testing.assert_close(docs[:, :7], whole[:, :7], **STANDIN_FP32.as_dict())
        torch.testing.assert_close(docs[:, 7:], alone, **STANDIN_FP32.as_dict())


def test_causal_conv1d_gradcheck():
    x, w = _randn(1, 9, 3).requires_grad_(), _randn(3, 4).flip(0).requires_grad_()
    cu = torch.tensor([0, 4, 9])
    assert torch.autograd.gradcheck(
        lambda x, w: s.causal_conv1d(x, w, activation="silu", cu_seqlens=cu)[0], (x, w)
    )


def _kda_inputs(T, dtype):
    gen = torch.Generator().manual_seed(GEN)
    q, k, raw = (torch.randn(1, T, 2, 8, generator=gen, dtype=dtype) for _ in range(3))
    v = torch.randn(1, T, 2, 16, generator=gen, dtype=dtype)
    beta = 2 * torch.sigmoid(torch.randn(1, T, 2, generator=gen, dtype=dtype))
    a_log = torch.rand(2, generator=gen, dtype=dtype).mul(15).add(1).log()
    dt_bias = torch.randn(16, generator=gen, dtype=dtype)
    return q, k, v, raw, beta, a_log, dt_bias


def test_chunk_kda_matches_fla_naive_chunk():
    q, k, v, raw, beta, a_log, dt_bias = _kda_inputs(128, torch.float32)
    o, state = s.chunk_kda(
        q,
        k,
        v,
        raw,
        beta,
        A_log=a_log,
        dt_bias=dt_bias,
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
        use_gate_in_kernel=True,
    )
    g = -a_log.exp()[:, None] * F.softplus(raw + dt_bias.view(2, 8))
    ref_o, ref_state = s.fla_naive().naive_chunk_kda(
        F.normalize(q, dim=-1, eps=0),
        F.normalize(k, dim=-1, eps=0),
        v,
        g,
        beta,
        output_final_state=True,
    )
    torch.testing.assert_close(o, ref_o, **STANDIN_CHUNK_KDA.as_dict())
    torch.testing.assert_close(state, ref_state, **STANDIN_CHUNK_KDA.as_dict())


def test_chunk_kda_documents_are_isolated():
    q, k, v, raw, beta, a_log, dt_bias = _kda_inputs(10, torch.float32)

    def run(q, k, v, raw, beta, cu_seqlens):
        return s.chunk_kda(
            q,
            k,
            v,
            raw,
            beta,
            A_log=a_log,
            dt_bias=dt_bias,
            cu_seqlens=cu_seqlens,
            use_qk_l2norm_in_kernel=True,
            use_gate_in_kernel=True,
        )[0]

    packed = run(q, k, v, raw, beta, torch.tensor([0, 3, 10]))
    alone = run(*(x[:, 3:] for x in (q, k, v, raw, beta)), None)
    torch.testing.assert_close(packed[:, 3:], alone, **STANDIN_FP32.as_dict())


def test_in_kernel_l2norm_and_gate_gradcheck():
    """The parts the stand-in writes itself; the recurrence's backward is FLA's reference's."""
    q, _, _, raw, _, a_log, dt_bias = (x.requires_grad_() for x in _kda_inputs(5, torch.float64))
    assert torch.autograd.gradcheck(s.l2_normalize, (q,))
    assert torch.autograd.gradcheck(s.kda_gate, (raw, a_log, dt_bias))


def _routing(N, k, E, dtype=torch.float64):
    gen = torch.Generator().manual_seed(GEN)
    routing_map = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(N)])
    probs = torch.rand(N, k, generator=gen, dtype=dtype)
    return routing_map, probs


def test_grouped_gemm_matches_per_row_weights():
    """Row i of the output is row i times the weight of its group; an empty group is skipped."""
    a, batch_sizes = _randn(9, 4), torch.tensor([3, 0, 6])
    group = torch.repeat_interleave(torch.arange(3), batch_sizes)
    for trans_b, b in ((False, _randn(3, 4, 5)), (True, _randn(3, 5, 4))):
        w = b.transpose(1, 2) if trans_b else b
        expected = torch.einsum("nk,nkm->nm", a, w[group])
        torch.testing.assert_close(
            s.grouped_gemm(a, b, batch_sizes, trans_b), expected, **STANDIN_FP64.as_dict()
        )


def test_grouped_gemm_gradcheck():
    a, b = _randn(7, 3).requires_grad_(), _randn(2, 4, 3).requires_grad_()
    assert torch.autograd.gradcheck(
        lambda a, b: s.grouped_gemm(a, b, torch.tensor([5, 2]), trans_b=True), (a, b)
    )


def _expert_scale(rows, row_id_map, routing_map):
    """An expert-specific map of permuted rows: row * (expert + 1)."""
    experts = routing_map.reshape(-1)[row_id_map]
    return rows * (experts + 1).unsqueeze(-1).to(rows.dtype)


def test_permute_groups_rows_by_expert_in_token_order():
    x = _randn(6, 3)
    routing_map, _ = _routing(6, 2, 4)
    rows, row_id_map = s.moe_permute(inp=x, routing_map=routing_map, map_type="index")
    experts = routing_map.reshape(-1)[row_id_map]
    assert torch.all(experts[1:] >= experts[:-1])
    for e in range(4):
        tokens = row_id_map[experts == e] // 2
        assert torch.all(tokens[1:] > tokens[:-1])
    torch.testing.assert_close(rows, x[row_id_map // 2], **BITWISE.as_dict())


def test_permute_unpermute_match_a_token_loop():
    """permute -> an expert-specific map -> unpermute gives each token the prob-weighted sum of
    its experts' results, as a plain loop over tokens and slots."""
    x = _randn(6, 3)
    routing_map, probs = _routing(6, 2, 4)
    rows, row_id_map = s.moe_permute(inp=x, routing_map=routing_map, map_type="index")
    out = s.moe_unpermute(
        inp=_expert_scale(rows, row_id_map, routing_map),
        row_id_map=row_id_map,
        merging_probs=probs,
        restore_shape=x.shape,
        map_type="index",
    )
    expected = torch.stack(
        [sum(probs[t, j] * (routing_map[t, j] + 1) * x[t] for j in range(2)) for t in range(6)]
    )
    torch.testing.assert_close(out, expected, **STANDIN_FP64.as_dict())


def test_permute_unpermute_gradcheck():
    routing_map, probs = _routing(5, 2, 3)
    x = _randn(5, 3).requires_grad_()

    def combine(x, probs):
        rows, row_id_map = s.moe_permute(inp=x, routing_map=routing_map, map_type="index")
        rows = _expert_scale(rows, row_id_map, routing_map)
        return s.moe_unpermute(
            inp=rows, row_id_map=row_id_map, merging_probs=probs, map_type="index"
        )

    assert torch.autograd.gradcheck(combine, (x, probs.requires_grad_()))


def test_async_copy_to_cpu_is_a_finished_copy():
    counts = torch.tensor([3, 0, 6])
    copy, stream, event = s.async_copy_to_cpu(counts, event=None)
    event.synchronize()
    assert stream is None and torch.equal(copy, counts) and copy.data_ptr() != counts.data_ptr()


def test_block_moe_path_matches_a_token_loop():
    """With every MoE stand-in installed, OLMo-core's own no-EP path in an OLMoDDPTransformerBlock
    (host copy, streams, permute, grouped GEMM, unpermute) equals a loop over tokens and their
    chosen experts through the latent projections, plus the shared expert (evaluation mode)."""
    from goldens.moe import MoECut, build_block

    s.install_moe()
    block = build_block(torch.Generator().manual_seed(GEN)).eval()
    cut, routing = MoECut(block), {}
    block.routed_experts_router.register_forward_hook(
        lambda module, args, out: routing.update(weights=out[0], indices=out[1])
    )
    x = _randn(1, 16, block.d_model, dtype=torch.float32)
    with torch.no_grad():
        block(x, segment_ids=torch.zeros(1, 16, dtype=torch.long))
        m, experts = cut.m[0], block.routed_experts
        z = block.latent_down_proj(m)
        routed = torch.zeros_like(z)
        for t in range(16):
            for w, e in zip(routing["weights"][0, t], routing["indices"][0, t], strict=True):
                up, gate = (z[t] @ experts.w_up_gate[e].T).chunk(2)
                routed[t] += w * ((up * F.silu(gate)) @ experts.w_down[e])
        up, gate = (m @ block.shared_experts.w_up_gate).chunk(2, dim=-1)
        expected = (
            block.latent_up_proj(routed) + (up * F.silu(gate)) @ block.shared_experts.w_down[0]
        )
    torch.testing.assert_close(cut.out[0], expected, **STANDIN_MOE_BLOCK.as_dict())


def _unknown_argument_calls():
    x = torch.zeros(1, 4, 8)
    norm = s.FusedRMSNormGated(8)
    return {
        "chunk_kda": lambda: s.chunk_kda(x, x, x, x, x[..., 0], fused_recompute=True),
        "causal_conv1d": lambda: s.causal_conv1d(x, torch.zeros(8, 4), seq_idx=None),
        "FusedRMSNormGated.forward": lambda: norm(x, x, weight_fp8=True),
        "moe_permute": lambda: s.moe_permute(x[0], torch.zeros(4, 1), pad_offsets=None),
        "moe_unpermute": lambda: s.moe_unpermute(x[0], torch.arange(4), probs_fp32=True),
    }


@pytest.mark.parametrize("stand_in", list(_unknown_argument_calls()))
def test_stand_ins_refuse_arguments_they_do_not_implement(stand_in):
    """A kernel option OLMo-core might pass is never dropped silently."""
    with pytest.raises(s.StandInError, match=rf"CPU stand-in {stand_in} got \['\w+'\]"):
        _unknown_argument_calls()[stand_in]()
