"""Test set-up for every pytest process (xdist workers too): 8 simulated CPU devices and float32
matmuls at "highest" precision, both fixed before JAX is imported; a persistent compilation
cache; golden fixtures through the golden store, so a missing or stale golden fails naming the
file and how to regenerate it. The costliest tests start first, and in a session that holds the
slow stage's epoch the workers beside it run at a lower CPU priority (`CRITICAL_PATH_COST`). The
gate's modules that compile one program run on one worker (`SHARED_STEP_SCOPES`).

`pytest -m tpu` (the TPU leg, tests/test_tpu.py) lets JAX pick its backend instead: a TPU host's
chips, with the CPU beside them; elsewhere the CPU alone, and those tests skip saying so.
`--tpu-transcendentals accurate|default` picks libtpu's float32 exp and log family before the chip
opens (accurate unless given); `--tpu-record PATH` writes what the tests measured, for
docs/tpu.md (`python -m bench.tpu_leg`)."""

import contextlib
import getpass
import json
import os
import re
import tempfile
from pathlib import Path

# Before anything imports jax: XLA reads these once, at backend start.
_flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "", os.environ.get("XLA_FLAGS", ""))
os.environ["XLA_FLAGS"] = f"{_flags} --xla_force_host_platform_device_count=8".strip()
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402

from goldens.store import Golden, GoldenError, load_golden  # noqa: E402
from parity.tpu_runtime import TRANSCENDENTALS, use_transcendentals  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

# Compiled executables persist in this machine's temp folder (unless JAX_COMPILATION_CACHE_DIR
# says otherwise): xdist workers reuse each other's compiles, and later runs (`tox -e slow` after
# the gate) the gate's. Keyed by XLA on the program, flags and versions, so a change recompiles.
if not jax.config.jax_compilation_cache_dir:
    cache = os.path.join(tempfile.gettempdir(), f"olmo-parity-jax-cache-{getpass.getuser()}")
    jax.config.update("jax_compilation_cache_dir", cache)

# XLA compilation dominates a JAX example: no deadline; fixed derandomised examples in the gate.
settings.register_profile("gate", deadline=None, derandomize=True, print_blob=True)
settings.load_profile("gate")


TPU_MARK = "tpu"


def pytest_addoption(parser):
    parser.addoption(
        "--tpu-record",
        type=Path,
        default=None,
        help="with -m tpu on a TPU host: write what the TPU tests measured to this JSON file",
    )
    parser.addoption(
        "--tpu-transcendentals",
        choices=TRANSCENDENTALS,
        default="accurate",
        help="with -m tpu: libtpu's float32 exp and log family (parity.tpu_runtime; accurate)",
    )


def pytest_configure(config):
    if config.option.markexpr == TPU_MARK:  # JAX's backend has not started yet
        jax.config.update("jax_platforms", "")
        use_transcendentals(config.option.tpu_transcendentals)


@pytest.fixture(scope="session")
def tpu_transcendentals(request) -> str:
    """The float32 transcendentals this session asked libtpu for (`--tpu-transcendentals`)."""
    return request.config.option.tpu_transcendentals


CRITICAL_PATH_COST = 1000
"""A test at least this costly (`pytest.mark.cost`: the slow stage's epoch) sets the stage's
length by itself."""
BESIDE_CRITICAL_PATH_NICENESS = 15
"""The niceness an xdist worker takes when it runs any other test in a session that holds one:
on 2 cores the epoch (OLMo-core's one torch thread and the JAX side) then keeps its own pace and
the other tests take the CPU it leaves, instead of sharing it evenly and stretching the epoch."""
_HOLDS_CRITICAL_PATH = pytest.StashKey[bool]()
_NICE = pytest.StashKey[bool]()


def _cost(item) -> float:
    mark = item.get_closest_marker("cost")
    return 0.0 if mark is None else mark.args[0]


def pytest_collection_modifyitems(items):
    """The costliest tests first (`pytest.mark.cost`: the slow stage's epoch and injected
    faults), collection order otherwise: the slow stage's work-stealing xdist starts the long
    ones at once and the others fill in beside them."""
    items.sort(key=lambda item: -_cost(item))


SHARED_STEP_SCOPES = (
    (
        "tests/test_lockstep.py",
        "tests/test_lockstep_past_warmup.py",
        "tests/test_olmo_core_state.py",
    ),
    ("tests/test_train.py", "tests/test_replay.py", "tests/test_diagnosis.py"),
)
"""Modules whose fixtures compile one program of the trace's config on one device: lockstep's
step parts (`parity.run.take_step`), then the free-running replay's whole step. Each group is one
xdist scope, so one worker compiles its program and the group's other modules reuse it. As
separate scopes two workers could compile the same program at once, each for 25-30 s on 2
cores, before either had written it to the persistent cache."""


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """`--dist loadscope` by module, but each group of `SHARED_STEP_SCOPES` as one scope."""
    if config.getoption("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    scope_of = {module: group[0] for group in SHARED_STEP_SCOPES for module in group}

    class SharedStepScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return scope_of.get(module) or super()._split_scope(nodeid)

    return SharedStepScheduling(config, log)


def pytest_collection_finish(session):
    """Whether the tests left to run (after -m and -k) hold a critical path."""
    holds = any(_cost(item) >= CRITICAL_PATH_COST for item in session.items)
    session.config.stash[_HOLDS_CRITICAL_PATH] = holds


def pytest_runtest_setup(item):
    """An xdist worker running a test beside the critical path lowers its CPU priority, once
    (an unprivileged process cannot raise it again; the worker that starts with the epoch keeps
    its own)."""
    config = item.config
    beside = config.stash.get(_HOLDS_CRITICAL_PATH, False) and _cost(item) < CRITICAL_PATH_COST
    if beside and os.environ.get("PYTEST_XDIST_WORKER") and not config.stash.get(_NICE, False):
        _lower_priority(BESIDE_CRITICAL_PATH_NICENESS)
        config.stash[_NICE] = True


def _lower_priority(niceness: int) -> None:
    """Every thread of this process (Linux gives each its own niceness: XLA's pool is already
    running) and those it starts later take `niceness`."""
    tasks = Path("/proc/self/task")
    for tid in [int(t.name) for t in tasks.iterdir()] if tasks.is_dir() else [0]:
        # a thread that has ended meanwhile, or a sandbox that refuses: the tests run as before
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, tid, niceness)


@pytest.fixture(scope="session")
def golden():
    """`golden("<path in goldens/>")` -> verified `Golden`; fails the test if missing or stale."""
    cache: dict[str, Golden] = {}

    def load(path: str) -> Golden:
        if path not in cache:
            try:
                cache[path] = load_golden(path)
            except GoldenError as error:
                pytest.fail(str(error), pytrace=False)
        return cache[path]

    return load


@pytest.fixture(scope="session")
def tpu_record(request):
    """`tpu_record(check, quantity, highest=..., default=..., bound=...)`: one measured row of
    the TPU leg (its value at matmul precision "highest", which the test holds to `bound`, and at
    "default"); written to `--tpu-record` when the session ends."""
    rows: list[dict] = []

    def record(check: str, quantity: str, *, highest: float, default: float, bound: float):
        rows.append(
            {"check": check, "quantity": quantity, "highest": float(highest)}
            | {"default": float(default), "bound": float(bound), "ok": bool(highest <= bound)}
        )

    yield record
    path = request.config.getoption("--tpu-record")
    if path is not None and rows:
        device = jax.devices()[0]
        written = {"platform": device.platform, "device": device.device_kind, "rows": rows}
        written["transcendentals"] = request.config.option.tpu_transcendentals
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(written, indent=1))
