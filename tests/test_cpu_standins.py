"""The exporter's CPU stand-ins for FLA's GPU-only kernels (goldens/cpu_standins.py), each against
an independent reference: OLMo-core's RMSNorm, torch's Conv1d (which OLMo-core's CausalConv1d
subclasses), FLA's naive_chunk_kda; backward by fp64 gradcheck; documents of cu_seqlens isolated."""

import torch
import torch.nn.functional as F

from goldens import cpu_standins as s

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
        torch.testing.assert_close(norm(x, g), reference(x) * torch.sigmoid(g), rtol=0, atol=1e-6)


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
        torch.testing.assert_close(y, whole, rtol=0, atol=1e-6)
        docs, _ = s.causal_conv1d(x, w, activation="silu", cu_seqlens=torch.tensor([0, 7, 20]))
        alone, _ = s.causal_conv1d(x[:, 7:], w, activation="silu")
        torch.testing.assert_close(docs[:, :7], whole[:, :7], rtol=0, atol=1e-6)
        torch.testing.assert_close(docs[:, 7:], alone, rtol=0, atol=1e-6)


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
    torch.testing.assert_close(o, ref_o, rtol=0, atol=1e-5)
    torch.testing.assert_close(state, ref_state, rtol=0, atol=1e-5)


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
    torch.testing.assert_close(packed[:, 3:], alone, rtol=0, atol=1e-6)


def test_in_kernel_l2norm_and_gate_gradcheck():
    """The parts the stand-in writes itself; the recurrence's backward is FLA's reference's."""
    q, _, _, raw, _, a_log, dt_bias = (x.requires_grad_() for x in _kda_inputs(5, torch.float64))
    assert torch.autograd.gradcheck(s.l2_normalize, (q,))
    assert torch.autograd.gradcheck(s.kda_gate, (raw, a_log, dt_bias))
