"""Statistics for comparing two policies on the same prompts, and the interval of a proportion."""

from __future__ import annotations

import math
import random
import statistics
from typing import Callable, Sequence


def analytical_win_rate(delta: float, std_a: float, std_b: float) -> float:
    """Phi(delta / sqrt(std_a^2 + std_b^2)): the published tables' win rate of b over a."""
    scale = math.sqrt(std_a ** 2 + std_b ** 2)
    if scale == 0:
        return 0.5 if delta == 0 else float(delta > 0)
    return 0.5 * (1 + math.erf(delta / scale / math.sqrt(2)))


def win_score(score: float, other: float) -> float:
    """1 when ``score`` beats ``other``, 0.5 on a tie, else 0."""
    if score > other:
        return 1.0
    if score == other:
        return 0.5
    return 0.0


def paired_win_rate(a: Sequence[float], b: Sequence[float]) -> float:
    """Share of prompts where b's reward beats a's; ties count half."""
    return statistics.fmean(win_score(y, x) for x, y in zip(a, b))


def mean_delta(a: Sequence[float], b: Sequence[float]) -> float:
    return statistics.fmean(y - x for x, y in zip(a, b))


def bootstrap_ci(a: Sequence[float], b: Sequence[float], statistic: Callable, resamples: int = 2000,
                 level: float = 0.95, seed: int = 0) -> tuple[float, float]:
    """Percentile interval of ``statistic(a, b)`` over paired resamples of the prompts
    (Efron & Tibshirani 1993).

    Of the sorted resampled statistics, as many are left out above the interval as below it: with
    2000 resamples at 95%, 50 on each side, so the bounds are the 51st smallest (index 50) and the
    51st largest (index 1949).
    """
    rng = random.Random(seed)
    n = len(a)
    values = []
    for _ in range(resamples):
        idx = [rng.randrange(n) for _ in range(n)]
        values.append(statistic([a[i] for i in idx], [b[i] for i in idx]))
    values.sort()
    # + 1e-9: 0.05 / 2 * 1000 is 24.999...
    tail = min(resamples - 1, int((1 - level) / 2 * resamples + 1e-9))
    return values[tail], values[resamples - 1 - tail]


def wilson_interval(successes: int, total: int, z: float = 1.96) -> tuple[float, float]:
    """95% Wilson score interval of a proportion (Wilson 1927): centre (p + z^2/2n) / (1 + z^2/n),
    half-width z sqrt(p(1-p)/n + z^2/4n^2) / (1 + z^2/n); (0, 1) when ``total`` is 0."""
    if total == 0:
        return (0.0, 1.0)
    p = successes / total
    denominator = 1 + z * z / total
    centre = (p + z * z / (2 * total)) / denominator
    half = z * (p * (1 - p) / total + z * z / (4 * total * total)) ** 0.5 / denominator
    return (max(0.0, centre - half), min(1.0, centre + half))


def bootstrap_mean_ci(values: Sequence[float], resamples: int = 2000, level: float = 0.95,
                      seed: int = 0) -> tuple[float, float]:
    """Percentile interval of the mean of ``values`` over resamples of them (Efron & Tibshirani
    1993): :func:`bootstrap_ci` with a one-sample statistic, the same bounds (with 2000 resamples at
    95%, the 51st smallest and the 51st largest resampled mean)."""
    return bootstrap_ci(values, values, lambda _, resampled: statistics.fmean(resampled), resamples,
                        level, seed)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased estimate of pass@k for one problem from ``n`` samples of which ``c`` succeeded:
    1 - C(n-c, k) / C(n, k), the chance that k of the n samples drawn without replacement hold at
    least one success (Chen et al. 2021, "Evaluating Large Language Models Trained on Code", eq. 1;
    the benchmark's pass@k is its mean over problems).

    With n = k it is 1 when any sample succeeded, else 0; with k = 1 it is c / n. Exact integer
    binomials (``math.comb``), so no cancellation for large n. ``k`` must be 1 to n, ``c`` 0 to n.
    """
    if not 1 <= k <= n or not 0 <= c <= n:
        raise ValueError(f"pass@k needs 1 <= k <= n and 0 <= c <= n (n={n}, c={c}, k={k})")
    if n - c < k:
        return 1.0  # every draw of k holds a success
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def sign_flip_p_value(a: Sequence[float], b: Sequence[float], resamples: int = 5000,
                      seed: int = 0) -> float:
    """Two-sided paired permutation test of mean(b - a) = 0: flip the sign of
    each difference at random."""
    rng = random.Random(seed)
    diffs = [y - x for x, y in zip(a, b)]
    observed = abs(sum(diffs))
    extreme = sum(abs(sum(d if rng.random() < 0.5 else -d for d in diffs)) >= observed - 1e-12
                  for _ in range(resamples))
    return (extreme + 1) / (resamples + 1)


def distinct_n(texts: Sequence[str], n: int) -> float:
    """Corpus-level Distinct-n: unique word n-grams over all word n-grams of all texts."""
    grams = [tuple(words[i:i + n]) for words in (t.split() for t in texts)
             for i in range(len(words) - n + 1)]
    return len(set(grams)) / len(grams) if grams else 0.0


def student_t_tail(t: float, df: int) -> float:
    """P(T > t) for Student's t with ``df`` (a positive integer) degrees of freedom, exactly.

    Abramowitz & Stegun (1964) 26.7.3-26.7.4: with theta = atan(t / sqrt(df)), A = P(|T| < t) is
    (2/pi) (theta + sin theta cos theta (1 + (2/3) cos^2 + (2.4)/(3.5) cos^4 + ... up to
    cos^(df-3))) for odd df (2 theta / pi for df = 1) and sin theta (1 + (1/2) cos^2 + (1.3)/(2.4)
    cos^4 + ... up to cos^(df-2)) for even df; the tail is (1 - A) / 2 for t >= 0.
    """
    if t < 0:
        return 1.0 - student_t_tail(-t, df)
    theta = math.atan(t / math.sqrt(df))
    cos2 = math.cos(theta) ** 2
    term = total = 1.0
    if df % 2:
        for j in range(1, (df - 1) // 2):
            term *= cos2 * (2 * j) / (2 * j + 1)
            total += term
        series = math.sin(theta) * math.cos(theta) * total if df > 1 else 0.0
        inside = 2 / math.pi * (theta + series)
    else:
        for j in range(1, df // 2):
            term *= cos2 * (2 * j - 1) / (2 * j)
            total += term
        inside = math.sin(theta) * total
    return (1.0 - inside) / 2


def student_t_quantile(tail: float, df: int) -> float:
    """The t with P(T > t) = ``tail`` (0 < tail <= 1/2) for ``df`` degrees of freedom: bisection of
    :func:`student_t_tail` in theta = atan(t / sqrt(df)) over [0, pi/2), to double precision."""
    low, high = 0.0, math.pi / 2
    for _ in range(60):
        middle = (low + high) / 2
        if student_t_tail(math.sqrt(df) * math.tan(middle), df) > tail:
            low = middle
        else:
            high = middle
    return math.sqrt(df) * math.tan((low + high) / 2)


def spending_weight(look: int) -> float:
    """w_k = 6 / (pi^2 k^2), the share of a test's level spent on its k-th look (k = 1, 2, ...).

    The weights sum to one over infinitely many looks (Euler's sum_k 1/k^2 = pi^2/6), so tests at
    levels alpha * w_k keep the chance that any look ever fires at most alpha by Bonferroni's
    (Boole's) inequality, however long the run: alpha spent over an open-ended sequence of looks,
    the union-bound construction of the confidence sequences of Darling & Robbins (1967, "Confidence
    sequences for mean, variance, and median", PNAS 58:66-68). Three quarters of the level go to the
    first two looks (0.61, 0.15), then it thins out: ``look`` counts over the whole run.
    """
    if look < 1:
        raise ValueError(f"looks count from 1 (got {look})")
    return 6.0 / (math.pi ** 2 * look ** 2)


def two_proportion_z(successes_a: int, total_a: int, successes_b: int, total_b: int) -> float:
    """The pooled two-proportion z statistic of p_a > p_b (Agresti 2013, "Categorical Data
    Analysis", 3rd ed., 3.1.3): z = (p_a - p_b) / sqrt(p (1 - p) (1/n_a + 1/n_b)) with
    p_i = x_i / n_i and the pooled p = (x_a + x_b) / (n_a + n_b); 0 when either total is 0 or p is 0
    or 1 (no spread: nothing to tell apart). Written here rather than taken from statsmodels,
    which the torch-free wing does not install, for three lines of arithmetic.
    """
    if total_a == 0 or total_b == 0:
        return 0.0
    pooled = (successes_a + successes_b) / (total_a + total_b)
    spread = pooled * (1 - pooled) * (1 / total_a + 1 / total_b)
    if spread <= 0:
        return 0.0
    return (successes_a / total_a - successes_b / total_b) / math.sqrt(spread)
