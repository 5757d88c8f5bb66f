"""`parity.profile`'s split of a step by op family (`bench tpu-profile`), on this CPU: an op goes
to the innermost of the model's named scopes in its HLO metadata, a fusion without one to the
family most of its ops carry, an op of none to copies and layout or other compute by its opcode.
A chunk KDA gradient's lowered module carries the inverse, intra-chunk and inter-chunk families,
so the scopes the model sets and the ones the profile reads are the same names (read before
compiling: the persistent compile cache's keys leave metadata out, so a cached executable can
carry an older module's names). Every named scope the model's FLOPs are counted by is a family."""

import collections
import re

import jax
import jax.numpy as jnp
import pytest

from model.config import olmo35_slice
from model.flops import UNSCOPED, scope_flops, step_flops
from model.kda_chunk import chunk_kda
from parity.profile import (
    FAMILIES,
    LAYOUT,
    OTHER,
    HloOp,
    classify,
    family_flops,
    family_of,
    hlo_ops,
)


def test_the_innermost_scope_names_the_family():
    path = "jit(train_step)/transpose(jvp(kda))/kda_intra_chunk/kda_inverse/while/body/dot"
    assert family_of(path) == FAMILIES["kda_inverse"]
    assert family_of("jit(f)/jvp(kda)/mul") == FAMILIES["kda"]
    assert family_of("s['attention']['w_q']") is None, "a parameter's name is no scope"
    assert family_of("jit(f)/causal_attention/add") is None, "only a whole scope name counts"


def test_a_fusion_takes_its_ops_family_and_a_bare_op_its_opcodes():
    router = ["jit(f)/router/dot_general", "jit(f)/router/add", "jit(f)/kda/mul"]
    assert classify(HloOp("fusion", "", tuple(router))) == FAMILIES["router"]
    assert classify(HloOp("copy", "")) == LAYOUT
    assert classify(HloOp("fusion", "")) == OTHER
    assert classify(None) == OTHER


def test_a_compiled_kda_gradient_carries_the_chunk_families():
    B, T, H, K, V = 1, 32, 1, 8, 8
    keys = jax.random.split(jax.random.key(0), 5)
    q, k = (jax.random.normal(key, (B, T, H, K)) for key in keys[:2])
    v = jax.random.normal(keys[2], (B, T, H, V))
    g = -jax.nn.softplus(jax.random.normal(keys[3], (B, T, H, K)))
    beta = jax.nn.sigmoid(jax.random.normal(keys[4], (B, T, H)))

    def loss(q, k, v, g, beta):
        return jnp.sum(chunk_kda(q, k, v, g, beta, chunk_size=16)[0])

    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))
    text = grad.lower(q, k, v, g, beta).as_text(debug_info=True)
    families = collections.Counter(map(family_of, re.findall(r'loc\("([^"]*)"', text)))
    for scope in ("kda_inverse", "kda_intra_chunk", "kda_inter_chunk"):
        assert families[FAMILIES[scope]] > 0, (scope, families)


def test_an_hlo_modules_text_gives_each_instruction_its_metadata_and_a_fusions_ops():
    text = """HloModule m

%fused_computation (p: f32[4]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  ROOT %exp.1 = f32[4]{0} exponential(%p), metadata={op_name="jit(f)/router/exp"}
}

ENTRY %main (x: f32[4]) -> f32[4] {
  %x = f32[4]{0} parameter(0)
  %copy.2 = f32[4]{0} copy(%x)
  ROOT %fusion.3 = f32[4]{0} fusion(%copy.2), kind=kLoop, calls=%fused_computation
}
"""
    ops = hlo_ops(text)
    assert ops["fusion.3"] == HloOp("fusion", "", ("jit(f)/router/exp",))
    assert classify(ops["fusion.3"]) == FAMILIES["router"]
    assert classify(ops["copy.2"]) == LAYOUT


def test_the_models_flops_go_to_the_families():
    flops = scope_flops(olmo35_slice())
    by_family = family_flops(flops)
    assert by_family[OTHER] == flops[UNSCOPED]
    assert by_family[FAMILIES["kda_inverse"]] == flops["kda_inverse"]
    assert set(by_family) <= {*FAMILIES.values(), OTHER}
    assert sum(by_family.values()) == step_flops(olmo35_slice())
    with pytest.raises(ValueError, match=r"no profile family takes: \['kda_scan'\]"):
        family_flops(flops | {"kda_scan": 1.0})
