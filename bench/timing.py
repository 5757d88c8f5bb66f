"""Wall-clock timing for benchmarks: best of several runs after a warm-up (compilation)."""

import time
from collections.abc import Callable


def best_seconds(fn: Callable[[], object], *, repeats: int = 10) -> float:
    """Minimum wall time of `fn()` over `repeats` runs; `fn` must block until its work is done."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best
