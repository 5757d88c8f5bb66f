"""Goldens of Kimi Delta Attention, fp32, the micro config's KDA shape (2 heads, d_k 32, d_v 64).

- `kda_layer.safetensors`: OLMo-core's `KimiDeltaAttention` (d_model 64, allow_neg_eigval, conv 4
  without bias), run on CPU with the stand-ins of `goldens.runtime.standins`; input x [2, 256, 64]
  (4 chunks), its weights (OLMo-core names), output y, and the gradients of sum(y * cotangent)
  (cotangent N(0, 1 / (B*T))) with respect to x and every weight. Weights are drawn at
  trained-like scale (linear std 1/sqrt(fan_in)) rather than at init (std 0.02), so that no
  part of the layer is negligible.
- `kda_chunk.safetensors`: FLA's references on kernel inputs (q, k L2-normed, g from the gate,
  beta = 2 sigmoid): `naive_chunk_kda` at T = 256 with its chunk tensors A (strictly lower,
  beta-scaled) and (I + A)^-1 diag(beta) (`chunk_systems`: FLA's formulas, checked by finishing
  the chunked algorithm from them to FLA's output), its output and final state (forward only: its
  backward is NaN); `naive_recurrent_kda` at T = 256 with the gradients of sum(o * do) +
  sum(S * dS), and at T = 1024 (16 chunks) forward.
"""

from __future__ import annotations

from goldens.runtime.models import EXPERIMENTAL_KERNELS_OFF, kda_config
from goldens.runtime.standins import SUBSTITUTIONS, fla_naive, install
from goldens.runtime.torch_layers import layer_vjp, to_numpy
from goldens.store import GoldenFile
from goldens.tolerances import KDA_CHUNK_SYSTEMS, KDA_FORWARD, KDA_GRAD, REGENERATE_COMPONENT
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
CHUNK_SIZE = KDA.chunk_size
A_LOG_RANGE = (1, 16)
"""A_log = log U(1, 16) (decay rates exp(A_log) of 1 to 16), in the layer and the kernel inputs."""
CHUNK_SYSTEMS_SOURCE = (
    "chunk.A, chunk.T_beta: naive_chunk_kda keeps them internal; goldens.kda.chunk_systems "
    "computes them with its formulas in its op order, checked by finishing the chunked algorithm "
    "from them to naive_chunk_kda's o and final state (KDA_CHUNK_SYSTEMS)"
)
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
                p.copy_(torch.empty_like(p).uniform_(*A_LOG_RANGE, generator=generator).log())
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
    a_log = torch.empty(H).uniform_(*A_LOG_RANGE, generator=generator).log()
    raw = torch.randn(B, T, H, K, generator=generator) - 3.0  # weak decay, as trained gates
    g = -a_log.exp()[:, None] * F.softplus(raw)
    beta = 2 * torch.sigmoid(torch.randn(B, T, H, generator=generator))
    state = torch.randn(B, H, K, V, generator=generator)
    return {"q": q, "k": k, "v": v, "g": g, "beta": beta, "initial_state": state}


def _chunks(x):
    """[B, T, H, ...] -> [B, H, N, C, ...], C = `CHUNK_SIZE`, contiguous."""
    B, T, H = x.shape[:3]
    return x.reshape(B, T // CHUNK_SIZE, CHUNK_SIZE, H, *x.shape[3:]).movedim(3, 1).contiguous()


def chunk_systems(k, g, beta):
    """The chunk matrices of FLA's `naive_chunk_kda` on kernel inputs k [B, T, H, K], g [B, T, H, K]
    and beta [B, T, H], each [B, H, N, C, C]: A[c, i] = beta_c sum_d k_cd exp(G_cd - G_id) k_id for
    i < c (G the in-chunk cumsum of g), 0 elsewhere, and T_beta = (I + A)^-1 diag(beta). Returns
    (A, T_beta, G). Computed in FLA's op order (A a column at a time; the inverse by forward
    substitution, a row at a time, each update summed over whole rows), so the bits are FLA's."""
    import torch

    k, beta, G = _chunks(k), _chunks(beta), _chunks(g).cumsum(-2)
    columns = [
        torch.einsum("...cd,...d->...c", k * (G - G[..., i : i + 1, :]).exp(), k[..., i, :])
        for i in range(CHUNK_SIZE)
    ]
    A = (torch.stack(columns, -1) * beta[..., None]).tril(-1)
    inverse = -A  # becomes (I + A)^-1 - I, row by row
    for row in range(1, CHUNK_SIZE):
        inverse[..., row, :row] += (inverse[..., row, :, None] * inverse[..., :, :row]).sum(-2)
    T_beta = (inverse + torch.eye(CHUNK_SIZE)) * beta[..., None, :]
    return A, T_beta, G


def _finish_chunks(q, k, v, T_beta, G, initial_state):
    """The chunked delta rule from T_beta and G (q, k [B, T, H, K], v [B, T, H, V], state
    [B, H, K, V]): per chunk, the pseudo-values T_beta (v - exp(G) k S) read out by decayed causal
    q k^T scores plus the decayed state. Returns (o [B, T, H, V], final state)."""
    import torch

    q, k, v = _chunks(q) * q.shape[-1] ** -0.5, _chunks(k), _chunks(v)
    w, u = T_beta @ (G.exp() * k), T_beta @ v
    causal = torch.ones(CHUNK_SIZE, CHUNK_SIZE, dtype=torch.bool).tril()
    state, out = initial_state, []
    for n in range(q.shape[2]):
        q_n, k_n, G_n = q[:, :, n], k[:, :, n], G[:, :, n]  # [B, H, C, K]
        decay = (G_n[..., :, None, :] - G_n[..., None, :, :]).exp()  # [B, H, C, C, K]
        scores = (q_n[..., :, None, :] * decay * k_n[..., None, :, :]).sum(-1)
        values = u[:, :, n] - w[:, :, n] @ state  # [B, H, C, V]
        out.append((q_n * G_n.exp()) @ state + scores.masked_fill(~causal, 0) @ values)
        last = G_n[..., -1:, :]  # [B, H, 1, K]
        state = state * last.mT.exp() + ((last - G_n).exp() * k_n).mT @ values
    return torch.stack(out, 2).flatten(2, 3).movedim(1, 2), state


def _naive_chunk_with_systems(inputs) -> dict:
    """FLA's `naive_chunk_kda` on `inputs`, its o and final state, with its chunk matrices A and
    T_beta from `chunk_systems`, checked: the chunked algorithm finished from them must give FLA's
    o and final state."""
    import importlib.metadata

    import torch

    o, state = fla_naive().naive_chunk_kda(**inputs, output_final_state=True, chunk_size=CHUNK_SIZE)
    A, T_beta, G = chunk_systems(inputs["k"], inputs["g"], inputs["beta"])
    finished = _finish_chunks(
        inputs["q"], inputs["k"], inputs["v"], T_beta, G, inputs["initial_state"]
    )
    for name, ours, fla in zip(("o", "final_state"), finished, (o, state), strict=True):
        try:
            torch.testing.assert_close(ours, fla, **KDA_CHUNK_SYSTEMS.as_dict())
        except AssertionError as error:
            raise RuntimeError(
                f"fla-core {importlib.metadata.version('fla-core')}: naive_chunk_kda's {name} "
                "differs from the chunked algorithm finished from goldens.kda.chunk_systems' "
                "T_beta; FLA's chunk formulas are no longer the ones chunk.A and chunk.T_beta "
                "record"
            ) from error
    return {"o": o, "final_state": state, "A": A, "T_beta": T_beta}


def export_chunk(generator) -> GoldenFile:
    import torch

    naive = fla_naive()
    tensors = {}
    chunk_inputs = _kernel_inputs(generator, CHUNK_T)
    tensors.update({f"chunk.{k}": v for k, v in chunk_inputs.items()})
    tensors.update({f"chunk.{k}": v for k, v in _naive_chunk_with_systems(chunk_inputs).items()})

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
            "chunk_size": CHUNK_SIZE,
            "T": {"chunk": CHUNK_T, "recurrent": CHUNK_T, "long": LONG_T},
            "layouts": {"chunk.A, chunk.T_beta": "[B, H, N, C, C]"},
        },
        tolerances=TOLERANCES,
        substitutions=[
            "FLA's pure-torch references only; no triton kernel involved",
            CHUNK_SYSTEMS_SOURCE,
        ],
    )


def export() -> list[GoldenFile]:
    import torch

    install()
    return [
        export_layer(torch.Generator().manual_seed(SEED)),
        export_chunk(torch.Generator().manual_seed(SEED + 1)),
    ]
