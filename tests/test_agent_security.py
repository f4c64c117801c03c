"""The security review of the agent runtime (issue 20): calculator, context fitting, control tokens, terminal."""

import pytest

from slm_align.agent import builtin_tools
from slm_align.agent.builtin_tools import calculator

# --- 3. calculator stall ------------------------------------------------------------------------------------------


class Spy:
    """Stands in for a calculator function: records the integer arguments it is given, computes nothing big."""

    def __init__(self, real):
        self.real = real
        self.largest = 0

    def __call__(self, *args):
        self.largest = max([self.largest] + [abs(a) for a in args if isinstance(a, int)])
        if self.largest > 10_000:
            return 0  # what the real function would spend seconds to hours on
        return self.real(*args)


@pytest.mark.parametrize("expression", ["round(1, -10**7)", "round(10**3000, -10**9)", "round(7, 10**8)",
                                        "round(2.5, -10**6)"])
def test_calculator_refuses_arguments_that_drive_huge_work_before_calling(monkeypatch, expression):
    spy = Spy(round)
    monkeypatch.setitem(builtin_tools._FUNCTIONS, "round", spy)
    with pytest.raises(ValueError, match="round"):
        calculator(expression)
    assert spy.largest == 0  # refused before round saw the argument


@pytest.mark.parametrize("expression", ["pow(2, 10**9)", "factorial(10**6)", "1 << 10**9", "2 ** 10**9",
                                        "(10**4000) * (10**4000)"])
def test_calculator_has_no_unbounded_operation(expression):
    with pytest.raises(ValueError):
        calculator(expression)


def test_calculator_still_rounds_within_bounds():
    assert calculator("round(123456, -3)") == "123000"
    assert calculator("round(pi, 4)") == "3.1416"
    assert calculator("round(2.5)") == "2"
