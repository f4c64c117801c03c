"""Single built-in operations checked before they run (sandbox/checks.py)."""

from __future__ import annotations

import pytest

from slm_align.ondevice.templates.sandbox.budget import (
    TEMPLATE_CHARS,
    TEMPLATE_INT_BITS,
    Budget,
    TemplateLimit,
    budgeted,
)
from slm_align.ondevice.templates.sandbox.checks import (
    bounded_filter,
    bounded_sum,
    check_binop,
    check_codec,
    check_filter,
    check_format,
    check_method,
    check_scan,
    check_strftime,
    replaced_size,
    whole,
)


def test_whole_takes_ints_only():
    """Bools and other types are 0 (mutation: True taken as width 1, or '9' parsed)."""
    assert [whole(5), whole(True), whole("9"), whole(2.0), whole(-3)] == [5, 0, 0, 0, -3]


@pytest.mark.parametrize("text, old, new, count", [
    ("aaa", "a", "bb", None), ("aaa", "a", "bb", 2), ("abc", "", "-", None),
    (b"xyx", b"x", b"zzz", None), ("aaa", "a", "bb", -1),
])
def test_replaced_size_matches_a_growing_replace(text, old, new, count):
    """A replace that grows the text is predicted exactly (mutation: empty-old or count rule wrong)."""
    real = text.replace(old, new) if count is None else text.replace(old, new, count)
    assert replaced_size(text, old, new, count) == len(real)


def test_replaced_size_is_an_upper_bound_when_shrinking():
    """Shrinking replaces are bounded by the text's own length (mutation: negative growth allowed)."""
    assert replaced_size("abcb", "b", "", None) == 4


def test_scan_bound():
    """Work past TEMPLATE_SCAN is refused with what it was doing (mutation: check dropped)."""
    check_scan(10, "strips")
    with pytest.raises(TemplateLimit, match="it strips: more than"):
        check_scan(10**12, "strips")


def test_format_widths():
    """A width in the pattern or a '*' argument past the bound is refused; normal formats pass
    (mutation: argument widths ignored)."""
    check_format("%5d", (3,))
    check_format("{:>10}", ("x",), {})
    with pytest.raises(TemplateLimit, match="wider than"):
        check_format(f"%{TEMPLATE_CHARS + 1}d", (1,))
    with pytest.raises(TemplateLimit):
        check_format("%*d", (TEMPLATE_CHARS + 1, 1))
    with pytest.raises(TemplateLimit):
        check_format("{:{w}}", (), {"w": TEMPLATE_CHARS + 1})
    with pytest.raises(TemplateLimit):
        check_format(b"%*d", (TEMPLATE_CHARS + 1, 1))


def test_strftime_refuses_field_widths_and_long_patterns():
    """'%1000Y' and patterns over 256 characters are refused; '%d %b %Y' passes (mutation: width regex)."""
    check_strftime("%d %b %Y")
    with pytest.raises(TemplateLimit, match="field width"):
        check_strftime("%1000Y")
    with pytest.raises(TemplateLimit, match="256"):
        check_strftime("x" * 257)


def test_codecs_allowed_and_refused():
    """Linear codecs pass by any alias; punycode and namereplace are refused (mutation: allow-list skipped)."""
    check_codec("encode", ("UTF8",), {})
    check_codec("encode", (), {"encoding": "latin-1"})
    with pytest.raises(TemplateLimit, match="punycode"):
        check_codec("encode", ("punycode",), {})
    with pytest.raises(TemplateLimit, match="namereplace"):
        check_codec("encode", ("ascii", "namereplace"), {})


def test_binop_repetition_and_concatenation():
    """'x' * n past the bound is refused before it is made; + sums sizes and keeps depth
    (mutation: repetition unchecked, or depth lost)."""
    budget = Budget()
    assert check_binop(budget, "*", "ab", 3) == (6, 0)
    assert check_binop(budget, "*", 3, [[1]]) == (3 * Budget().size([[1]]), 2)
    assert check_binop(budget, "+", [1], [[2]]) == (Budget().size([1]) + Budget().size([[2]]), 2)
    with pytest.raises(TemplateLimit):
        check_binop(budget, "*", "x", TEMPLATE_CHARS + 1)


def test_binop_integer_growth():
    """2 ** huge is refused; 1 ** huge is not (it stays 1) (mutation: abs(left) > 1 exemption dropped)."""
    budget = Budget()
    assert check_binop(budget, "**", 2, 100) is None
    assert check_binop(budget, "**", 1, 10**9) is None
    with pytest.raises(TemplateLimit, match=f"{TEMPLATE_INT_BITS:,} bits"):
        check_binop(budget, "**", 2, TEMPLATE_INT_BITS + 1)
    with pytest.raises(TemplateLimit, match="wider than"):
        check_binop(budget, "%", "%*d", (TEMPLATE_CHARS + 1, 1))


def test_text_methods():
    """Padding, replace, join and to_bytes are checked; join's iterable comes back as a list
    (mutation: a method left unchecked, or a generator consumed and lost)."""
    budget = Budget()
    assert check_method(budget, "x", "center", (10,), {}) == (10,)
    with pytest.raises(TemplateLimit):
        check_method(budget, "x", "ljust", (TEMPLATE_CHARS + 1,), {})
    with pytest.raises(TemplateLimit):
        check_method(budget, "x" * 1000, "replace", ("x", "y" * 10_000), {})
    assert check_method(budget, ",", "join", (iter(["a", "b"]),), {}) == (["a", "b"],)
    with pytest.raises(TemplateLimit):
        check_method(budget, 5, "to_bytes", (TEMPLATE_CHARS + 1,), {})
    with pytest.raises(TemplateLimit, match="strips a set"):
        check_method(budget, "a" * 100_000, "strip", ("b" * 10_000,), {})


def test_sorting_filters_charge_n_log_n():
    """sort charges n * bit_length(n) steps, map n (mutation: sorting charged linearly)."""
    budget = Budget(steps=10_000)
    check_filter(budget, "sort", [list(range(100))], {})
    assert budget.steps == 10_000 - 100 * 7
    check_filter(budget, "map", [list(range(100))], {})
    assert budget.steps == 10_000 - 700 - 100


def test_filter_checks_by_name():
    """indent, wordwrap and urlize are bounded (mutation: an entry missing from FILTER_CHECKS)."""
    budget = Budget()
    with pytest.raises(TemplateLimit):
        check_filter(budget, "indent", ["a\n" * 1000, TEMPLATE_CHARS], {})
    with pytest.raises(TemplateLimit, match="urlizes"):
        check_filter(budget, "urlize", ["x" * 100_001], {})
    with pytest.raises(TemplateLimit, match="wraps words"):
        check_filter(Budget(), "wordwrap", ["a" * 1_000_000, 1], {})


def test_bounded_filter_ticks_and_counts_its_result():
    """A wrapped filter takes a step and counts what it made (mutation: result not counted)."""
    def upper(value):
        return value.upper()
    with budgeted(Budget(steps=5)) as budget:
        assert bounded_filter("upper", upper)("abc") == "ABC"
        assert budget.steps == 4
        assert budget.made_chars == 3


def test_bounded_sum_adds_numbers_only():
    """Numbers add up; lists are refused (mutation: list concatenation allowed)."""
    assert bounded_sum(None, [1, 2, 3.5]) == 6.5
    with pytest.raises(TypeError, match="adds numbers"):
        bounded_sum(None, [[1], [2]], start=[])
    with pytest.raises(TypeError):
        bounded_sum(None, [True])
