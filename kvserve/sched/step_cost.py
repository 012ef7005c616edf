"""What an engine step costs: seconds ~ fixed + per_token x tokens + per_sequence x sequences.

Latency targets need to know how long a step of a given shape takes before running it: to cap the
tokens of a step so that it ends in time, and to predict when a queued request gets its first token.
Tokens (prompt chunks and decodes) pay for the GEMMs; sequences pay for what each row that is
sampled costs on top (the vocabulary projection, sampling, detokenizing, attention over its context).
A decode token therefore costs more than a prompt token, which a single per-token rate cannot show.

The three coefficients come from a weighted least-squares fit of the steps the engine has run, the
older ones forgotten geometrically so that the model follows the machine (another process taking
the cores, longer contexts). A start-up calibration (a few timed forwards) gives the first estimate,
so predictions hold from the first request on. Coefficients are kept non-negative: noise in a few
samples must not make long steps look free.
"""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Optional

from kvserve.stats import StepCoefficients

# Weight of a step after each newer one: ~100 steps of memory, a few seconds of a busy GPU engine.
FORGETTING = 0.99
# A calibration sample counts as this many steps: the first few real steps (often odd ones: a warm-up
# request, one decode) must not swing the fit away from it, but real steps, which also pay for the
# host's sampling and output work that the probe forwards lack (measured on the 2-core CPU: see
# docs/slo_scheduling.md#what-it-does), should take over within a few dozen steps.
CALIBRATION_WEIGHT = 2.0
# Ridge term (relative to each feature's own scale) so that a fit of steps of one shape stays solvable.
RIDGE = 1e-6
_NUM_FEATURES = 3
# Calibration (measure_step_shapes): prompt lengths double from the first until a forward takes this
# many times the first one's time, where its cost grows with its tokens (a GPU reads the weights in
# the same time for 64 tokens as for 1,024: below that the per-token cost does not show).
CALIBRATION_FIRST_TOKENS = 64
CALIBRATION_LINEAR_FACTOR = 3.0
CALIBRATION_SEQUENCES = 32      # the decode-like shape: this many sequences of one token
CALIBRATION_RUNS = 2            # timed runs per shape after a warm-up run; the fastest is kept


@dataclass(frozen=True)
class StepShape:
    num_tokens: int        # tokens computed in the step (prompt chunks + one per decoding request)
    num_sequences: int     # requests in the step (each samples or at least attends)

    def features(self) -> tuple[float, float, float]:
        return (1.0, float(self.num_tokens), float(self.num_sequences))


class StepCostModel:
    """The fit: add observations with `observe`, read `coefficients` (None before any data)."""

    def __init__(self, forgetting: float = FORGETTING) -> None:
        self.forgetting = forgetting
        self._gram = [[0.0] * _NUM_FEATURES for _ in range(_NUM_FEATURES)]   # sum w x x^T
        self._moment = [0.0] * _NUM_FEATURES                                   # sum w x y
        self._energy = 0.0                                                     # sum w y^2
        self._coefficients: Optional[StepCoefficients] = None
        self.num_observations = 0

    def observe(self, shape: StepShape, seconds: float, weight: float = 1.0) -> None:
        if seconds <= 0 or shape.num_tokens <= 0:
            return
        x = shape.features()
        decay = self.forgetting
        for i in range(_NUM_FEATURES):
            self._moment[i] = decay * self._moment[i] + weight * x[i] * seconds
            for j in range(_NUM_FEATURES):
                self._gram[i][j] = decay * self._gram[i][j] + weight * x[i] * x[j]
        self._energy = decay * self._energy + weight * seconds * seconds
        self.num_observations += 1
        self._coefficients = None

    def calibrate(self, samples: Iterable[tuple[StepShape, float]]) -> None:
        for shape, seconds in samples:
            self.observe(shape, seconds, weight=CALIBRATION_WEIGHT)

    @property
    def coefficients(self) -> Optional[StepCoefficients]:
        if self._coefficients is None and self.num_observations:
            self._coefficients = StepCoefficients(*self._fit())
        return self._coefficients

    def seconds(self, num_tokens: int, num_sequences: int) -> Optional[float]:
        coefficients = self.coefficients
        return None if coefficients is None else coefficients.seconds(num_tokens, num_sequences)

    # --- least squares over the non-negative coefficients ------------------------------------------
    def _fit(self) -> tuple[float, float, float]:
        """The best non-negative fit: the unconstrained one if it is, else the best over the subsets
        of coefficients (with 3 of them, trying all 7 is cheaper than an iterative solver)."""
        best, best_residual = (0.0, 0.0, 0.0), math.inf
        for size in range(_NUM_FEATURES, 0, -1):
            for subset in itertools.combinations(range(_NUM_FEATURES), size):
                solution = self._solve(subset)
                if solution is None or any(value < 0 for value in solution):
                    continue
                residual = self._residual(solution)
                if residual < best_residual - 1e-15:
                    best, best_residual = solution, residual
        return best

    def _solve(self, subset: tuple[int, ...]) -> Optional[tuple[float, float, float]]:
        matrix = [[self._gram[i][j] * (1.0 + RIDGE if i == j else 1.0) for j in subset] for i in subset]
        vector = [self._moment[i] for i in subset]
        values = _gauss_solve(matrix, vector)
        if values is None:
            return None
        full = [0.0] * _NUM_FEATURES
        for index, value in zip(subset, values):
            full[index] = value
        return (full[0], full[1], full[2])

    def _residual(self, theta: tuple[float, float, float]) -> float:
        quadratic = sum(theta[i] * self._gram[i][j] * theta[j]
                        for i in range(_NUM_FEATURES) for j in range(_NUM_FEATURES))
        return self._energy - 2 * sum(t * m for t, m in zip(theta, self._moment)) + quadratic


def _gauss_solve(matrix: list[list[float]], vector: list[float]) -> Optional[list[float]]:
    """Solves a small dense system by Gaussian elimination with partial pivoting; None if singular."""
    n = len(vector)
    rows = [list(row) + [value] for row, value in zip(matrix, vector)]
    for column in range(n):
        pivot = max(range(column, n), key=lambda r: abs(rows[r][column]))
        if abs(rows[pivot][column]) < 1e-300:
            return None
        rows[column], rows[pivot] = rows[pivot], rows[column]
        for r in range(column + 1, n):
            factor = rows[r][column] / rows[column][column]
            for c in range(column, n + 1):
                rows[r][c] -= factor * rows[column][c]
    solution = [0.0] * n
    for r in range(n - 1, -1, -1):
        solution[r] = (rows[r][n] - sum(rows[r][c] * solution[c] for c in range(r + 1, n))) / rows[r][r]
    return solution


def measure_step_shapes(forward: Callable[[int, int], None], token_budget: int,
                        max_num_seqs: int) -> list[tuple[StepShape, float]]:
    """Times `forward(num_tokens, num_sequences)` (which must return once the device is done) at
    the shapes that tell the three coefficients apart: the two longest prompt lengths of a doubling
    ladder that stops where the cost grows with the tokens (or at the budget), and a decode-like
    shape of many one-token sequences. Each shape runs once to warm up (allocations, packed weights,
    kernel variants), then the fastest of a few runs is kept: another process on the cores only ever
    adds time."""
    def timed(num_tokens: int, num_sequences: int) -> float:
        forward(num_tokens, num_sequences)
        best = math.inf
        for _ in range(CALIBRATION_RUNS):
            started = time.perf_counter()
            forward(num_tokens, num_sequences)
            best = min(best, time.perf_counter() - started)
        return best

    first = min(token_budget, CALIBRATION_FIRST_TOKENS)
    ladder = [(first, timed(first, 1))]
    while ladder[-1][0] < token_budget and ladder[-1][1] < CALIBRATION_LINEAR_FACTOR * ladder[0][1]:
        tokens = min(token_budget, 2 * ladder[-1][0])
        ladder.append((tokens, timed(tokens, 1)))
    samples = [(StepShape(tokens, 1), seconds) for tokens, seconds in ladder[-2:]]
    sequences = min(max_num_seqs, token_budget, CALIBRATION_SEQUENCES)
    samples.append((StepShape(sequences, sequences), timed(sequences, sequences)))
    return samples
