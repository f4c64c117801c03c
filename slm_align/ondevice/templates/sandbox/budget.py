"""A render's allowance (:class:`Budget`: steps, deadline, characters made) and the bounds it
enforces; the running render's budget lives in a context variable, so any thread can render."""

from __future__ import annotations

import time
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, Iterator, Optional

from jinja2.utils import Namespace

TEMPLATE_STEPS = 1_000_000
"""Steps one render may take (loop iterations, calls, filters, attribute lookups, operators, output
pieces). A real chat template takes tens per message: a 1,000-message conversation with tools stays
far below; three nested ``range(1000)`` loops do not."""
TEMPLATE_SECONDS = 2.0
"""Wall-clock seconds one render may take. Real templates render in milliseconds, on a phone too."""
TEMPLATE_CHARS = 4_000_000
"""Characters (a container: characters and items, nested ones included) of the rendered text and of
any value a template makes. A prompt fills the context: a 128k-token context at the runtime's 16
characters a token (:data:`~slm_align.ondevice.agent.prompt.MAX_CHARS_PER_TOKEN`) is 2M
characters."""
TEMPLATE_WORK_CHARS = 16 * TEMPLATE_CHARS
"""Characters made over one render, every value and output piece counted: the intermediate values of
a real template are a few times its text."""
TEMPLATE_INT_BITS = 16_384
"""Bits of an integer made by ``*`` or ``**`` (Python prints no integer of more than 4,300 digits,
about 14,300 bits)."""
TEMPLATE_SCAN = 500_000_000
"""Characters one built-in call may compare or copy where its work grows faster than its input (a
strip with a set of characters looks each stripped one up in the set; wrapping a word longer than
the width copies what is left of it for each line): half a second at most."""
TIME_CHECK_EVERY = 4096
"""Items measured between two clock readings while a large value is sized."""


class TemplateLimit(Exception):
    """The render ran past one of its bounds; the message says which."""


def check_size(size: int) -> int:
    """``size``, or a TemplateLimit beyond :data:`TEMPLATE_CHARS`."""
    if size > TEMPLATE_CHARS:
        raise TemplateLimit(f"it made a value of more than {TEMPLATE_CHARS:,} characters")
    return size


class Budget:
    """One render's allowance: steps left, its deadline, the characters made so far; and the sizes
    of the containers it measured (each measured once)."""

    def __init__(self, steps: int = TEMPLATE_STEPS, seconds: float = TEMPLATE_SECONDS):
        self.steps = steps
        self.deadline = time.monotonic() + seconds
        self.made_chars = 0
        self._sizes: dict[int, tuple[Any, int, int]] = {}
        """id -> (the container, kept alive so that its id stays its own; size; depth)."""

    def tick(self) -> None:
        """One step: refused past the step budget or the deadline."""
        self.charge(1)

    def charge(self, steps: int) -> None:
        """``steps`` steps (a built-in call's items, before it runs): refused past the step budget
        or the deadline."""
        self.steps -= steps
        if self.steps < 0:
            raise TemplateLimit(f"it took more than {TEMPLATE_STEPS:,} "
                                "steps (a loop that does not end?)")
        self.check_time()

    def check_time(self) -> None:
        if time.monotonic() > self.deadline:
            raise TemplateLimit(f"it ran longer than {TEMPLATE_SECONDS:g} "
                                "s (a loop that does not end?)")

    def made(self, value: Any) -> Any:
        """``value``, a result the template made, counted against the size and work bounds."""
        self.count(self.size(value))
        return value

    def count(self, chars: int) -> None:
        self.made_chars += chars
        if self.made_chars > TEMPLATE_WORK_CHARS:
            raise TemplateLimit(f"it made more than {TEMPLATE_WORK_CHARS:,} characters in all")

    def size(self, value: Any) -> int:
        """Characters of a string (bytes of a bytes value), and for a container the characters and
        items it holds (a part held twice counted twice, as its text would show it); refused beyond
        :data:`TEMPLATE_CHARS`."""
        return self.measure(value)[0]

    def depth(self, value: Any) -> int:
        return self.measure(value)[1]

    def measure(self, value: Any) -> tuple[int, int]:
        """(size, nesting depth) of ``value``."""
        if isinstance(value, (str, bytes, bytearray)):
            return check_size(len(value)), 0
        if isinstance(value, bool) or value is None or isinstance(value, float):
            return 1, 0
        if isinstance(value, int):
            return 1 + value.bit_length() // 3, 0
        if isinstance(value, Namespace):  # changes as the template sets its attributes: never kept
            return self._walk(object.__getattribute__(value, "_Namespace__attrs"))
        if isinstance(value, (list, tuple, dict, set, frozenset)):
            known = self._sizes.get(id(value))
            if known is not None:
                return known[1], known[2]
            size, depth = self._walk(value)
            self._sizes[id(value)] = (value, size, depth)
            return size, depth
        return 1, 0

    def _walk(self, held: Any) -> tuple[int, int]:
        total, depth = 1, 0
        for index, part in enumerate(held.items() if isinstance(held, dict) else held):
            if isinstance(held, dict):
                size, inner = self.measure(part[1])
                size += self.measure(part[0])[0]
            else:
                size, inner = self.measure(part)
            total = check_size(total + 1 + size)
            depth = max(depth, inner + 1)
            if index % TIME_CHECK_EVERY == TIME_CHECK_EVERY - 1:
                self.check_time()
        return total, depth

    def remember(self, value: Any, size: int, depth: int) -> Any:
        """A new value whose size and depth are known from its parts (``a + b``, ``a * n``):
        counted, and not walked again."""
        if isinstance(value, (list, tuple)):
            self._sizes[id(value)] = (value, check_size(size), depth)
        self.count(check_size(size))
        return value

    def iterate(self, iterable: Any) -> Iterator:
        """``iterable``'s items, one step each."""
        for item in iterable:
            self.tick()
            yield item


_BUDGET: ContextVar[Optional[Budget]] = ContextVar("template_budget", default=None)


def current() -> Budget:
    """The running render's budget; outside a render (Jinja folding constants at compile time) a
    fresh one, so that the size checks hold there too."""
    return _BUDGET.get() or Budget()


@contextmanager
def budgeted(budget: Optional[Budget] = None) -> Iterator[Budget]:
    """Run a render under ``budget`` (a fresh one by default)."""
    budget = budget or Budget()
    token = _BUDGET.set(budget)
    try:
        yield budget
    finally:
        _BUDGET.reset(token)
