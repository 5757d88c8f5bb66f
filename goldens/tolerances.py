"""Named tolerances: what each golden is compared with. The exporter records them in the manifest
and tests import them from here, so there is one place to read (and to loosen, visibly)."""

from dataclasses import dataclass


@dataclass(frozen=True)
class Tol:
    """Elementwise bound |actual - expected| <= atol + rtol * |expected|."""

    rtol: float
    atol: float

    def as_dict(self) -> dict[str, float]:
        return {"rtol": self.rtol, "atol": self.atol}


FP32_FORWARD = Tol(rtol=1e-5, atol=1e-6)
"""float32 forward outputs of one component."""
FP32_GRAD = Tol(rtol=1e-5, atol=1e-5)
"""float32 gradients of one component (input and weight)."""

REGENERATE_RTOL = 1e-6
"""`tox -e goldens-check`: a regenerated tensor equals the committed one bit for bit, or (another
CPU's kernels rounding differently) within this relative error. Also the ceiling a manifest may
state."""
