"""Global load balancing on 8 simulated devices (`Flags.moe_global_load_balancing`, OLMo-core
`global_load_balancing`): with expert counts averaged over the data axis, the mean of the devices'
load-balancing losses and its gradient equal the whole-batch loss on one device; device 0's own
value does not, and neither does balancing each device's tokens alone."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from goldens.tolerances import DEVICE_0_LB_VISIBLE, LOCAL_LB_FACTOR_VISIBLE, WHOLE_BATCH
from model.aux_losses import expert_counts, load_balancing_loss
from tests.compare import assert_close

DEVICES, ROWS, T, E, K = 8, 2, 16, 16, 2
D_TOTAL = float(DEVICES * ROWS * T)


def _lb(logits, *, div, axis_name=None):
    probs = jax.nn.softmax(logits, axis=-1)
    counts = expert_counts(jax.lax.top_k(probs, K)[1], E)
    return load_balancing_loss(probs, counts, top_k=K, loss_div_factor=div, axis_name=axis_name)


def _per_device(logits, *, global_lb):
    mesh = Mesh(np.array(jax.devices()[:DEVICES]), ("data",))

    @functools.partial(jax.shard_map, mesh=mesh, in_specs=P("data"), out_specs=P("data"))
    def local(x):  # x: this device's rows; OLMo-core's per-device D is the global count / W
        lb = _lb(x, div=D_TOTAL / DEVICES, axis_name="data" if global_lb else None)
        return lb[None]

    return local(logits)


def _logits():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((DEVICES * ROWS, T, E)).astype(np.float32)
    # each device's tokens favour other experts: locally unbalanced, globally balanced
    logits += 3.0 * np.eye(E, dtype=np.float32)[np.repeat(np.arange(DEVICES) * 2, ROWS)][:, None, :]
    return logits


def test_global_lb_equals_whole_batch_value_and_gradient():
    logits = _logits()
    whole, whole_grad = jax.value_and_grad(lambda x: _lb(x, div=D_TOTAL))(logits)
    mean = lambda x: jnp.mean(_per_device(x, global_lb=True))  # noqa: E731
    value, grad = jax.value_and_grad(mean)(logits)
    assert_close("value", expected=whole, actual=value, tol=WHOLE_BATCH)
    assert_close("grad", expected=whole_grad, actual=grad, tol=WHOLE_BATCH)
    device_0 = _per_device(logits, global_lb=True)[0]
    assert abs(float(device_0) - float(whole)) > DEVICE_0_LB_VISIBLE * float(whole), (
        "device 0 alone is not the batch"
    )


def test_local_lb_differs_from_whole_batch():
    logits = _logits()
    whole = _lb(logits, div=D_TOTAL)
    local = jnp.mean(_per_device(logits, global_lb=False))
    assert float(local) > LOCAL_LB_FACTOR_VISIBLE * float(whole), (float(local), float(whole))
