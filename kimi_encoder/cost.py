"""Cost of encoding one image as a function of its patch count.

Attention is quadratic in an image's patches and the rest is linear, so a
rank's time for an image of p patches is modelled as ``a*p^2 + b*p + c``,
fitted by non-negative least squares on a few timed grids at start-up.
``CostModel.patches()`` is the plain patch count (the reference rule).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class CostModel:
    a: float = 0.0  # seconds per patch^2
    b: float = 1.0  # seconds per patch
    c: float = 0.0  # seconds per image

    @classmethod
    def patches(cls) -> CostModel:
        return cls(0.0, 1.0, 0.0)

    def __call__(self, patches: float) -> float:
        return self.a * patches * patches + self.b * patches + self.c

    def as_dict(self) -> dict[str, float]:
        """The coefficients by name (``dataclasses.asdict`` deep-copies, many times slower,
        and a rank reports them with every answer)."""
        return {"a": self.a, "b": self.b, "c": self.c}

    @classmethod
    def fit(cls, samples: Sequence[tuple[float, float]]) -> CostModel:
        """Least squares over (patches, seconds) with a, b, c >= 0.

        Tries every subset of the three terms and keeps the best fit whose
        coefficients are all non-negative (exact NNLS for three unknowns).

        >>> m = CostModel.fit([(p, 2e-9 * p * p + 1e-6 * p + 1e-3) for p in (64, 256, 1024, 4096)])
        >>> round(m.a * 1e9, 3), round(m.b * 1e6, 3), round(m.c * 1e3, 3)
        (2.0, 1.0, 1.0)
        """
        if len(samples) < 1:
            raise ValueError("cannot fit a cost model without samples")
        p = np.asarray([s[0] for s in samples], dtype=np.float64)
        y = np.asarray([s[1] for s in samples], dtype=np.float64)
        columns = np.stack([p * p, p, np.ones_like(p)], axis=1)
        best, best_err = (0.0, float(y.mean() / max(p.mean(), 1.0)), 0.0), np.inf
        for k in range(1, 4):
            for subset in itertools.combinations(range(3), k):
                coef, *_ = np.linalg.lstsq(columns[:, subset], y, rcond=None)
                if np.any(coef < 0):
                    continue
                full = np.zeros(3)
                full[list(subset)] = coef
                err = float(np.sum((columns @ full - y) ** 2))
                if err < best_err - 1e-30:
                    best, best_err = tuple(float(v) for v in full), err
        return cls(*best)


def calibrate(run: Callable[[int], None], grids: Sequence[int], repeats: int = 2) -> CostModel:
    """Fit from timing ``run(side)`` (one image of side x side patches) per grid side."""
    samples = []
    for side in grids:
        run(side)  # warm-up
        best = min(_timed(run, side) for _ in range(repeats))
        samples.append((side * side, best))
    return CostModel.fit(samples)


def _timed(run: Callable[[int], None], side: int) -> float:
    start = time.perf_counter()
    run(side)
    return time.perf_counter() - start
