"""A render's allowance (sandbox/budget.py): steps, sizes, depth, the context variable."""

from __future__ import annotations

import pytest
from jinja2.utils import Namespace

from slm_align.ondevice.templates.sandbox.budget import (
    TEMPLATE_CHARS,
    TEMPLATE_STEPS,
    TEMPLATE_WORK_CHARS,
    Budget,
    TemplateLimit,
    budgeted,
    check_size,
    current,
)


def test_check_size_allows_the_bound_and_refuses_past_it():
    """TEMPLATE_CHARS itself passes, one more is refused (mutation: >= instead of >)."""
    assert check_size(TEMPLATE_CHARS) == TEMPLATE_CHARS
    with pytest.raises(TemplateLimit, match=f"more than {TEMPLATE_CHARS:,} characters"):
        check_size(TEMPLATE_CHARS + 1)


def test_steps_run_out_after_the_allowance():
    """Exactly `steps` ticks pass, the next is refused naming the step bound (mutation: off by one, no check)."""
    budget = Budget(steps=3)
    for _ in range(3):
        budget.tick()
    with pytest.raises(TemplateLimit, match=f"more than {TEMPLATE_STEPS:,} steps"):
        budget.tick()


def test_charge_takes_many_steps_at_once():
    """A built-in call's items are charged before it runs (mutation: charge counts one step)."""
    budget = Budget(steps=10)
    budget.charge(10)
    with pytest.raises(TemplateLimit):
        budget.charge(1)


def test_past_deadline_is_refused():
    """A budget with no time left refuses the next step (mutation: deadline never checked)."""
    budget = Budget(seconds=-1.0)
    with pytest.raises(TemplateLimit, match="ran longer than"):
        budget.tick()


@pytest.mark.parametrize("value, size", [
    ("abc", 3), (b"ab", 2), (None, 1), (True, 1), (1.5, 1), (7, 2),
    (["ab", "c"], 1 + (1 + 2) + (1 + 1)),
    ({"k": "vv"}, 1 + 1 + 2 + 1),
])
def test_size_of_values(value, size):
    """Strings by length, scalars 1, containers 1 + per item 1 + its size, dict keys counted
    (mutation: keys or per-item overhead dropped)."""
    assert Budget().size(value) == size


def test_part_held_twice_counts_twice():
    """A shared list counts once per place it appears, as its text would (mutation: dedup by id)."""
    inner = ["x" * 10]
    assert Budget().size([inner, inner]) == 1 + 2 * (1 + Budget().size(inner))


def test_depth_of_nested_containers():
    """Depth is the nesting of containers (mutation: depth not incremented)."""
    budget = Budget()
    assert budget.depth("x") == 0
    assert budget.depth([1]) == 1
    assert budget.depth({"a": [[1]]}) == 3


def test_oversized_container_is_refused():
    """A list whose parts sum past the bound is refused (mutation: check_size not applied while walking)."""
    half = "x" * (TEMPLATE_CHARS // 2)
    with pytest.raises(TemplateLimit):
        Budget().size([half, half, "y"])


def test_namespace_is_measured_each_time():
    """A Namespace changes as the template sets it: never cached (mutation: cached by id like a list)."""
    budget = Budget()
    space = Namespace(a="x")
    before = budget.size(space)
    space["a"] = "x" * 100
    assert budget.size(space) == before + 99


def test_made_counts_work_over_the_render():
    """Values made add up to the work bound across calls (mutation: made_chars not accumulated)."""
    budget = Budget()
    piece = "x" * TEMPLATE_CHARS
    for _ in range(TEMPLATE_WORK_CHARS // TEMPLATE_CHARS):
        budget.made(piece)
    with pytest.raises(TemplateLimit, match="in all"):
        budget.made("x")


def test_remember_counts_and_caches():
    """A value sized from its parts is counted and not walked again (mutation: size not kept)."""
    budget = Budget()
    value = ["a", "b"]
    assert budget.remember(value, 123, 4) is value
    assert budget.measure(value) == (123, 4)
    assert budget.made_chars == 123


def test_iterate_charges_a_step_per_item():
    """Mutation: iterate yields without ticking."""
    budget = Budget(steps=2)
    with pytest.raises(TemplateLimit):
        list(budget.iterate(range(3)))


def test_budgeted_sets_and_restores_the_current_budget():
    """Inside, current() is the render's budget; after, a fresh one again (mutation: not reset)."""
    mine = Budget(steps=5)
    with budgeted(mine) as running:
        assert running is mine
        assert current() is mine
    assert current() is not mine
    assert current() is not current()
