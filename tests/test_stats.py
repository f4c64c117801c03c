"""Each statistic of the evaluation report pinned on hand-computed inputs."""

import itertools
import math
import random

import pytest

from slm_align.stats import (
    analytical_win_rate,
    bootstrap_ci,
    bootstrap_mean_ci,
    distinct_n,
    mean_delta,
    paired_win_rate,
    pass_at_k,
    sign_flip_p_value,
    spending_weight,
    student_t_quantile,
    student_t_tail,
    two_proportion_z,
)


def test_analytical_win_rate_matches_the_paper_formula():
    # delta 1.355 over a combined std sqrt(s_a^2 + s_b^2) = 5.39 is Phi(0.2514) = 0.5993, by hand
    # from the normal table (the paper's Pythia-410M/TinyStories row reads +1.355 and 59.9%).
    assert analytical_win_rate(1.355, 3.811, 3.811) == pytest.approx(0.5993, abs=1e-3)
    assert analytical_win_rate(0.0, 1.0, 1.0) == 0.5
    assert analytical_win_rate(-1.0, 0.6, 0.8) == pytest.approx(0.5 * (1 + math.erf(-1.0 / 1.0 / math.sqrt(2))))
    assert analytical_win_rate(1.0, 0.0, 0.0) == 1.0


def test_paired_win_rate_counts_ties_half():
    assert paired_win_rate([1, 2, 3, 4], [2, 2, 1, 5]) == pytest.approx((1 + 0.5 + 0 + 1) / 4)


def test_distinct_n_is_corpus_level():
    texts = ["the cat sat", "the cat ran"]
    assert distinct_n(texts, 1) == pytest.approx(4 / 6)  # the, cat, sat, ran over 6 words
    assert distinct_n(texts, 2) == pytest.approx(3 / 4)  # (the cat) twice, (cat sat), (cat ran)
    assert distinct_n(["a"], 2) == 0.0


def test_bootstrap_interval_contains_the_true_delta():
    rng = random.Random(1)
    a = [rng.gauss(0.0, 1.0) for _ in range(300)]
    b = [x + 0.3 + rng.gauss(0.0, 0.5) for x in a]  # true mean improvement 0.3
    low, high = bootstrap_ci(a, b, mean_delta, resamples=1000)
    assert low < 0.3 < high and low > 0  # significant, and the truth is inside
    same = [x + rng.gauss(0.0, 0.5) for x in a]
    low, high = bootstrap_ci(a, same, mean_delta, resamples=1000)
    assert low < 0 < high  # no real change: the interval includes zero


def test_sign_flip_test_separates_real_and_null_changes():
    rng = random.Random(2)
    a = [rng.gauss(0, 1) for _ in range(100)]
    assert sign_flip_p_value(a, [x + 0.5 for x in a], resamples=500) < 0.01
    assert sign_flip_p_value(a, [x + rng.gauss(0, 0.1) for x in a], resamples=500) > 0.05


def test_bootstrap_bounds_leave_out_as_many_resamples_above_as_below():
    def ordinal(counter):
        def statistic(a, b):
            return next(counter)  # the resampled values are 0, 1, ..., resamples - 1
        return statistic

    assert bootstrap_ci([0.0], [0.0], ordinal(itertools.count()), resamples=2000, level=0.95) == (50, 1949)
    assert bootstrap_ci([0.0], [0.0], ordinal(itertools.count()), resamples=1000, level=0.9) == (50, 949)


def test_student_t_tail_matches_closed_forms_and_the_normal_for_many_degrees_of_freedom():
    assert student_t_tail(0.0, 7) == pytest.approx(0.5)
    assert student_t_tail(1.0, 1) == pytest.approx(0.25)  # Cauchy: 1/2 - atan(1)/pi
    for t in (0.5, 2.0, 9.0):  # df 2: 1/2 - t / (2 sqrt(t^2 + 2))
        assert student_t_tail(t, 2) == pytest.approx(0.5 - t / (2 * math.sqrt(t * t + 2)))
    assert student_t_tail(-2.0, 5) == pytest.approx(1 - student_t_tail(2.0, 5))
    normal = 0.5 * math.erfc(2.0 / math.sqrt(2))
    assert student_t_tail(2.0, 20001) == pytest.approx(normal, rel=1e-3)


@pytest.mark.parametrize("tail, df, table", [(0.025, 1, 12.706), (0.025, 2, 4.303), (0.025, 15, 2.131),
                                              (0.001, 15, 3.733), (0.005, 30, 2.750), (0.05, 120, 1.658)])
def test_student_t_quantile_matches_the_printed_tables(tail, df, table):
    assert student_t_quantile(tail, df) == pytest.approx(table, abs=5e-4)
    assert student_t_tail(student_t_quantile(tail, df), df) == pytest.approx(tail)


@pytest.mark.parametrize("n, c, k, expected", [
    (5, 2, 1, 0.4),  # c / n
    (5, 2, 2, 0.7),  # 1 - C(3, 2) / C(5, 2) = 1 - 3/10
    (5, 2, 3, 0.9),  # 1 - C(3, 3) / C(5, 3) = 1 - 1/10
    (5, 2, 4, 1.0),  # n - c = 3 < 4: every draw of 4 holds a success
    (5, 0, 2, 0.0), (5, 5, 2, 1.0), (1, 1, 1, 1.0), (1, 0, 1, 0.0),
    (2, 1, 2, 1.0), (2, 0, 2, 0.0),  # n = k: any success
    (10, 3, 5, 1 - 21 / 252),  # 1 - C(7, 5) / C(10, 5)
])
def test_pass_at_k_is_chen_et_als_unbiased_estimator_on_hand_computed_cases(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


def test_pass_at_k_agrees_with_its_definition_by_enumeration_and_refuses_bad_counts():
    outcomes = [1, 0, 0, 1, 0, 0]  # n = 6, c = 2: the share of the 3-subsets holding a success
    subsets = list(itertools.combinations(outcomes, 3))
    assert pass_at_k(6, 2, 3) == pytest.approx(sum(any(s) for s in subsets) / len(subsets))
    assert pass_at_k(200, 7, 100) == pytest.approx(1 - math.comb(193, 100) / math.comb(200, 100))
    for n, c, k in ((5, 2, 0), (5, 2, 6), (5, 6, 1), (5, -1, 1)):
        with pytest.raises(ValueError):
            pass_at_k(n, c, k)


def test_bootstrap_mean_interval_is_the_one_sample_percentile_interval():
    values = [0.0, 0.5, 1.0, 1.0, 0.0, 0.5, 1.0, 0.0]
    low, high = bootstrap_mean_ci(values, seed=3)
    assert low < sum(values) / len(values) < high and 0 <= low and high <= 1
    rng, means = random.Random(3), []
    for _ in range(2000):
        idx = [rng.randrange(len(values)) for _ in values]
        means.append(sum(values[i] for i in idx) / len(values))
    means.sort()
    assert (low, high) == (means[50], means[1949])
    assert bootstrap_mean_ci([1.0] * 5) == (1.0, 1.0)


def test_spending_weights_sum_to_one_over_an_open_ended_run():
    assert spending_weight(1) == pytest.approx(6 / math.pi ** 2)
    assert spending_weight(3) == pytest.approx(spending_weight(1) / 9)
    assert math.fsum(spending_weight(k) for k in range(1, 200_001)) == pytest.approx(1.0, abs=1e-5)
    with pytest.raises(ValueError):
        spending_weight(0)


def test_two_proportion_z_is_the_pooled_statistic():
    # 40 of 100 against 20 of 100: pooled 0.3, se sqrt(0.3 x 0.7 x 0.02) = 0.0648, z = 0.2 / 0.0648
    assert two_proportion_z(40, 100, 20, 100) == pytest.approx(3.086, abs=1e-3)
    assert two_proportion_z(20, 100, 40, 100) == pytest.approx(-3.086, abs=1e-3)
    assert two_proportion_z(0, 50, 0, 50) == 0.0 and two_proportion_z(5, 0, 1, 10) == 0.0


def test_a_pooled_two_proportion_test_keeps_its_level_on_equal_rates():
    rng = random.Random(0)
    fired = 0
    for _ in range(4000):
        a = sum(rng.random() < 0.1 for _ in range(160))
        b = sum(rng.random() < 0.1 for _ in range(160))
        fired += two_proportion_z(a, 160, b, 160) > 1.645
    assert 0.03 < fired / 4000 < 0.07  # one-sided 5%
