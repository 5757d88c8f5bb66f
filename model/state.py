"""What a run builds, in one place: the `Transformer` of a config, its train state laid out on a
mesh (`model.layout`), and the compiled train step.

Two compiled forms of `model.train_step`:
- `StepParts`: accumulate, then the optimizer, each jitted, so that the gradients before clipping
  come out between them: what lockstep and the teacher-forced replay take, and a step where a
  test's fault acts.
- `jit_train_step`: the whole step in one program, the state's buffers donated if asked: what
  free-running and the trainer take, and what `bench` measures.

On a mesh the params, gradients and Adam moments are laid out by their logical axes, the step
counts and the skip rule's history replicated, and the micro-batches' rows split over the batch
axes. On one device (mesh None) JAX's default device runs everything.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from model import optim
from model import train_step as ts
from model.config import Config
from model.layout import Layout, layout_of, param_shardings, with_shardings
from model.objective import model_terms_fn
from model.transformer import Transformer


def make_model(cfg: Config) -> Transformer:
    """`cfg`'s model with its initial weights (`TrainConfig.init_seed`)."""
    return Transformer.of(cfg.model, cfg.flags, rngs=nnx.Rngs(cfg.train.init_seed))


@functools.cache
def abstract_params(cfg: Config) -> tuple[nnx.GraphDef, nnx.State]:
    """The `Transformer` of `cfg` split into its graph and abstract params (nothing allocated;
    made once a config, so every step built from it shares one graph)."""
    return nnx.split(nnx.eval_shape(lambda: make_model(cfg)))


def abstract_init(cfg: Config, mesh: Mesh) -> nnx.State:
    """The params of `cfg`'s model as `jax.ShapeDtypeStruct`s carrying the `NamedSharding`s their
    logical axes give on `mesh`; nothing is allocated."""
    params = abstract_params(cfg)[1]
    return with_shardings(params, param_shardings(params, layout_of(cfg, mesh)))


def state_shardings(cfg: Config, layout: Layout, params: nnx.State) -> ts.TrainState:
    """NamedShardings in the structure of a `TrainState` of `params` (arrays or abstract): the
    Adam moments as the params, the step counts and skip history replicated."""
    ps = param_shardings(params, layout)
    opt_state = jax.eval_shape(lambda p: optim.init(p, cfg), params)
    replicated = NamedSharding(layout.mesh, P())
    return ts.TrainState(ps, optim.laid_out(opt_state, moments=ps, other=replicated), replicated)


@functools.cache
def abstract_state(cfg: Config, mesh: Mesh | None) -> ts.TrainState:
    """A `TrainState` of `cfg`'s model as `jax.ShapeDtypeStruct`s, laid out on `mesh` (None: on
    JAX's default device): the target a checkpoint is restored into (made once a config and
    mesh)."""
    params = abstract_params(cfg)[1]
    state = jax.eval_shape(lambda p: ts.init_state(p, cfg), params)
    if mesh is None:
        one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        return with_shardings(state, jax.tree.map(lambda _: one, state))
    return with_shardings(state, state_shardings(cfg, layout_of(cfg, mesh), params))


def placed(state: ts.TrainState, cfg: Config, mesh: Mesh | None) -> ts.TrainState:
    """`state` committed to the shardings of `abstract_state(cfg, mesh)`: however a state was
    made (in eager ops, by `init_train_state`, restored from a checkpoint), the compiled step
    then sees the same input shardings, so it is the same program bit for bit."""
    return jax.device_put(state, jax.tree.map(lambda t: t.sharding, abstract_state(cfg, mesh)))


def init_train_state(cfg: Config, mesh: Mesh) -> tuple[nnx.GraphDef, ts.TrainState]:
    """A fresh `TrainState` made sharded: each device computes only its own shards of the params
    and optimizer state (`jax.jit` with out_shardings), never a whole copy."""
    graphdef, abstract = abstract_params(cfg)
    shardings = state_shardings(cfg, layout_of(cfg, mesh), abstract)

    def init():
        return ts.init_state(nnx.state(make_model(cfg)), cfg)

    return graphdef, jax.jit(init, out_shardings=shardings)()


def _laid_out(cfg: Config, mesh: Mesh) -> tuple[ts.TrainState, NamedSharding]:
    """The shardings of `cfg`'s train state on `mesh` and those of its micro-batches' rows."""
    layout = layout_of(cfg, mesh)
    shardings = state_shardings(cfg, layout, abstract_params(cfg)[1])
    return shardings, layout.micro_batch_sharding(cfg.train.micro_batch_size)


def _update(params, grads, opt_state, step, loss, *, cfg: Config):
    return optim.step(params, grads, opt_state, step=step, loss=loss, cfg=cfg)


@dataclasses.dataclass(frozen=True)
class StepParts:
    """The train step's two jitted parts: `accumulate(params, micro_batches)` -> (gradients
    before clipping, terms), then `update(params, grads, opt_state, step, loss)` -> (params,
    opt_state, {"lr", "grad_norm", "skipped"}), as `model.train_step.train_step` composes them."""

    accumulate: Callable
    update: Callable

    def __call__(self, state: ts.TrainState, micro_batches, *, adjust_grads=None):
        """One step. `adjust_grads(grads)` acts between the parts (a test's fault). Returns
        (state, metrics as `train_step` reports them, gradients before clipping)."""
        grads, terms = self.accumulate(state.params, micro_batches)
        if adjust_grads is not None:
            grads = adjust_grads(grads)
        params, opt_state, metrics = self.update(
            state.params, grads, state.opt_state, state.step, terms["ce"]
        )
        return ts.TrainState(params, opt_state, state.step + 1), {**terms, **metrics}, grads


def step_parts(
    cfg: Config,
    graphdef: nnx.GraphDef,
    mesh: Mesh | None = None,
    *,
    terms_fn: ts.TermsFn | None = None,
    wrap_accumulate: Callable[[Callable], Callable] | None = None,
) -> StepParts:
    """`StepParts` of `cfg`'s model (`graphdef`) on `mesh` (None: one device). `terms_fn`
    replaces the model's terms (`model.objective.model_terms_fn`), `wrap_accumulate` wraps the
    accumulation before it is jitted (a test's fault)."""
    terms = model_terms_fn(graphdef, cfg, mesh=mesh) if terms_fn is None else terms_fn
    accumulate = functools.partial(ts.accumulate, cfg=cfg, terms_fn=terms)
    if wrap_accumulate is not None:
        accumulate = wrap_accumulate(accumulate)
    update = functools.partial(_update, cfg=cfg)
    if mesh is None:
        return StepParts(jax.jit(accumulate), jax.jit(update))
    laid_out, rows = _laid_out(cfg, mesh)
    params, opt, one = laid_out.params, laid_out.opt_state, laid_out.step
    accumulate = jax.jit(
        functools.partial(accumulate, grad_sharding=params),
        in_shardings=(params, rows),
        out_shardings=(params, one),
    )
    update = jax.jit(
        update, in_shardings=(params, params, opt, one, one), out_shardings=(params, opt, one)
    )
    return StepParts(accumulate, update)


def jit_train_step(
    cfg: Config,
    terms_fn: ts.TermsFn,
    *,
    shardings: ts.TrainState | None = None,
    rows: NamedSharding | None = None,
    donate: bool = False,
) -> Callable[[ts.TrainState, Any], tuple[ts.TrainState, dict]]:
    """The whole `model.train_step.train_step` as one jitted program: `step(state,
    micro_batches)` -> (state, metrics). With `shardings` (a `TrainState` of shardings) and
    `rows` (the micro-batches'), laid out as they say and each micro-batch's gradients kept as
    the params; `donate` hands the state's buffers to the step."""
    step = functools.partial(ts.train_step, cfg=cfg, terms_fn=terms_fn)
    donated = (0,) if donate else ()
    if shardings is None:
        return jax.jit(step, donate_argnums=donated)
    return jax.jit(
        functools.partial(step, grad_sharding=shardings.params),
        in_shardings=(shardings, rows),
        out_shardings=(shardings, None),
        donate_argnums=donated,
    )


def compiled_train_step(
    cfg: Config,
    graphdef: nnx.GraphDef,
    mesh: Mesh | None = None,
    *,
    terms_fn: ts.TermsFn | None = None,
    donate: bool = False,
):
    """`jit_train_step` of `cfg`'s model (`graphdef`) on `mesh` (None: one device), laid out by
    its logical axes; `terms_fn` replaces the model's terms, `donate` as `jit_train_step`."""
    terms = model_terms_fn(graphdef, cfg, mesh=mesh) if terms_fn is None else terms_fn
    if mesh is None:
        return jit_train_step(cfg, terms, donate=donate)
    shardings, rows = _laid_out(cfg, mesh)
    return jit_train_step(cfg, terms, shardings=shardings, rows=rows, donate=donate)
