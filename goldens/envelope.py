"""OLMo-core's own one-ulp envelope: how far a chaotic golden moves when its run starts from inputs
moved by one ulp. fp32 training does not reproduce itself: Adam turns rounding-level differences of
near-zero gradients into full-size updates and top-k routing flips, so a rerun on another CPU, or
any other fp32 implementation, lands somewhere inside this envelope rather than on the golden.

The trace records two such runs (`trace/perturbed.safetensors`: metrics [runs, steps, ...] and, at
the saved steps, each parameter's |p - p_golden| / |p_golden| [runs, params]);
`kda_trained_keys.safetensors` records its own ("spread.<name>").
"""

from __future__ import annotations

import numpy as np


def rel_gap(ours, golden) -> np.ndarray:
    """|ours - golden| / |golden| elementwise (the absolute gap where golden is 0)."""
    ours, golden = np.asarray(ours, np.float64), np.asarray(golden, np.float64)
    scale = np.where(golden == 0, 1.0, np.abs(golden))
    return np.abs(ours - golden) / scale


def norm_gap(ours, golden) -> float:
    """|ours - golden| / |golden| of a whole tensor (Frobenius norms)."""
    ours, golden = np.asarray(ours, np.float64), np.asarray(golden, np.float64)
    return float(np.linalg.norm(ours - golden) / max(np.linalg.norm(golden), np.finfo(float).tiny))


def metric_spread(runs: np.ndarray, golden: np.ndarray) -> np.ndarray:
    """runs [runs, steps] or [runs, steps, MoE blocks], golden [steps, ...] -> golden's shape: the
    largest relative gap of any perturbed run to the golden one at this step or before (chaos only
    grows). A per-block metric takes the largest over the blocks: two runs are too few to show each
    block its own early routing flips (a rerun's flip at step 3 in one block measured 23x that
    block's own spread, 3.8x the blocks' largest)."""
    gaps = rel_gap(runs, golden[None]).max(axis=0)
    if gaps.ndim == 2:
        gaps = np.broadcast_to(gaps.max(axis=1, keepdims=True), gaps.shape)
    return np.maximum.accumulate(gaps, axis=0)


def param_spread(runs: np.ndarray) -> np.ndarray:
    """[runs, params] relative distances at one saved step -> [params]: the farthest run's."""
    return np.asarray(runs, np.float64).max(axis=0)
