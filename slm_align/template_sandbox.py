"""Bounded rendering of chat templates: a template that loops, or grows a value without end, is
stopped within a bound instead of holding the thread (and a server's model thread) forever.

Templates come with downloaded models and with ``--chat-template FILE``. Jinja's sandbox keeps them
away from Python's internals and bounds ``range()``, but nested loops, recursive macros and
amplifying operations (``'A' * 10**11``, ``'x'.center(10**10)``, a string doubled in a loop) run
unbounded. Here every render has a :class:`Budget`:

- steps (:data:`TEMPLATE_STEPS`): each loop iteration, call, filter, attribute lookup, operator
  and output piece is one; a loop that never ends runs out of them;
- time (:data:`TEMPLATE_SECONDS`), checked at each step: a few slow steps are stopped too;
- size (:data:`TEMPLATE_CHARS`): no value the template makes, and not the rendered text, may
  exceed it; operations that would (repetition, padding, replacing, joining, formatting widths,
  integer powers) are refused *before* they allocate; a container's size counts what it holds;
- work (:data:`TEMPLATE_WORK_CHARS`): the characters made over the whole render, so that many
  values each within the size bound cannot add up to a huge text or a huge memory.

The checks live in the sandbox's hooks (``call``, ``getattr``, ``getitem``, intercepted operators,
``finalize``, the filters) and in the compiled template itself: a code generator wraps each ``for``
loop's iterable, each ``~`` concatenation and each list, tuple and dict literal in a call that
counts. ``{% include %}``, ``{% import %}`` and ``{% extends %}`` are refused at compile time (a
chat template is one file). No signals, no threads: it works on any thread, without torch.

A single built-in operation on values within these bounds (a sort, a comparison, a filter over a
long text) is not interrupted; the bounds keep each of them short, so a render ends within about
:data:`TEMPLATE_SECONDS` plus one such operation (a few seconds at most).
"""

from __future__ import annotations

import re
import time
from contextlib import contextmanager
from contextvars import ContextVar
from functools import wraps
from types import MethodType
from typing import Any, Callable, Iterator, Optional

from jinja2 import nodes, pass_context, pass_environment
from jinja2.compiler import CodeGenerator
from jinja2.exceptions import TemplateSyntaxError
from jinja2.filters import make_attrgetter
from jinja2.runtime import LoopContext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import Namespace
from jinja2.visitor import NodeTransformer

TEMPLATE_STEPS = 1_000_000
"""Steps one render may take (loop iterations, calls, filters, attribute lookups, operators, output
pieces). A real chat template takes tens per message: a 1,000-message conversation with tools stays
far below; three nested ``range(1000)`` loops do not."""
TEMPLATE_SECONDS = 2.0
"""Wall-clock seconds one render may take. Real templates render in milliseconds, on a phone too."""
TEMPLATE_CHARS = 4_000_000
"""Characters (a container: characters and items, nested ones included) of the rendered text and of any
value a template makes. A prompt fills the context: a 128k-token context at the runtime's 16
characters a token (:data:`~slm_align.agent.prompt.MAX_CHARS_PER_TOKEN`) is 2M characters."""
TEMPLATE_WORK_CHARS = 16 * TEMPLATE_CHARS
"""Characters made over one render, every value and output piece counted: the intermediate values of
a real template are a few times its text."""
TEMPLATE_INT_BITS = 16_384
"""Bits of an integer made by ``*`` or ``**`` (Python prints no integer of more than 4,300 digits,
about 14,300 bits)."""
TIME_CHECK_EVERY = 4096
"""Items measured between two clock readings while a large value is sized."""
FORMAT_NUMBER = re.compile(r"\d+")
SEQUENCES = (str, list, tuple, bytes)


class TemplateLimit(Exception):
    """The render ran past one of its bounds; the message says which."""


def check_size(size: int) -> int:
    """``size``, or a TemplateLimit beyond :data:`TEMPLATE_CHARS`."""
    if size > TEMPLATE_CHARS:
        raise TemplateLimit(f"it made a value of more than {TEMPLATE_CHARS:,} characters")
    return size


class Budget:
    """One render's allowance: steps left, its deadline, the characters made so far; and the sizes of
    the containers it measured (each measured once)."""

    def __init__(self, steps: int = TEMPLATE_STEPS, seconds: float = TEMPLATE_SECONDS):
        self.steps = steps
        self.deadline = time.monotonic() + seconds
        self.made_chars = 0
        self._sizes: dict[int, tuple[Any, int, int]] = {}
        """id -> (the container, kept alive so that its id stays its own; size; depth)."""

    def tick(self) -> None:
        """One step: refused past the step budget or the deadline."""
        self.steps -= 1
        if self.steps < 0:
            raise TemplateLimit(f"it took more than {TEMPLATE_STEPS:,} steps (a loop that does not end?)")
        self.check_time()

    def check_time(self) -> None:
        if time.monotonic() > self.deadline:
            raise TemplateLimit(f"it ran longer than {TEMPLATE_SECONDS:g} s (a loop that does not end?)")

    def made(self, value: Any) -> Any:
        """``value``, a result the template made, counted against the size and work bounds."""
        self.count(self.size(value))
        return value

    def count(self, chars: int) -> None:
        self.made_chars += chars
        if self.made_chars > TEMPLATE_WORK_CHARS:
            raise TemplateLimit(f"it made more than {TEMPLATE_WORK_CHARS:,} characters in all")

    def size(self, value: Any) -> int:
        """Characters of a string, and for a container the characters and items it holds (a part held
        twice counted twice, as its text would show it); refused beyond :data:`TEMPLATE_CHARS`."""
        return self.measure(value)[0]

    def depth(self, value: Any) -> int:
        return self.measure(value)[1]

    def measure(self, value: Any) -> tuple[int, int]:
        """(size, nesting depth) of ``value``."""
        if isinstance(value, str):
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
        """A new value whose size and depth are known from its parts (``a + b``, ``a * n``): counted,
        and not walked again."""
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


def render_bounded(template, variables: dict) -> str:
    """``template`` (compiled by a :class:`BoundedSandbox`) rendered with ``variables`` under a fresh
    budget; a TemplateLimit past a bound."""
    with budgeted() as budget:
        pieces = []
        total = 0
        for piece in template.generate(**variables):
            total += len(piece)
            if total > TEMPLATE_CHARS:
                raise TemplateLimit(f"its text grew past {TEMPLATE_CHARS:,} characters")
            pieces.append(piece)
        budget.check_time()
        return "".join(pieces)


def _whole(value: Any) -> int:
    """An integer argument (a width, a count), else 0."""
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _check_format(pattern: Any, args: Any, kwargs: Optional[dict] = None) -> None:
    """A printf or ``str.format`` pattern whose widths or precisions would make more than the size
    bound: a number in the pattern, or a number argument (``%*d``, ``{:{}}``)."""
    if not isinstance(pattern, str):
        return
    if any(int(number) > TEMPLATE_CHARS for number in FORMAT_NUMBER.findall(pattern)):
        raise TemplateLimit(f"it formats a field wider than {TEMPLATE_CHARS:,} characters")
    values = list(args) if isinstance(args, (tuple, list)) else [args]
    values += list((kwargs or {}).values()) + (list(args.values()) if isinstance(args, dict) else [])
    if ("*" in pattern or "{" in pattern) and any(abs(_whole(v)) > TEMPLATE_CHARS for v in values):
        raise TemplateLimit(f"it formats a field wider than {TEMPLATE_CHARS:,} characters")


def _replaced_size(text: str, old: Any, new: Any, count: Any = None) -> int:
    """The length ``text.replace(old, new, count)`` would have."""
    old, new = str(old), str(new)
    found = text.count(old) if old else len(text) + 1
    if count is not None and _whole(count) >= 0:
        found = min(found, _whole(count))
    return len(text) + found * max(0, len(new) - len(old))


def _joined(budget: Budget, items: Any, separator: Any) -> list:
    """``items`` as a list (one step each), refused when joining them with ``separator`` would pass
    the size bound."""
    items = items if isinstance(items, (list, tuple)) else list(budget.iterate(items))
    check_size(budget.size(items) + len(str(separator)) * len(items))
    return list(items)


def _check_binop(budget: Budget, operator: str, left: Any, right: Any) -> Optional[tuple[int, int]]:
    """Refuse ``left operator right`` when its result would pass a bound (checked before it is
    made); the result's (size, depth) when known from the operands."""
    if operator == "*" and (isinstance(left, SEQUENCES) and _whole(right) or isinstance(right, SEQUENCES)
                            and _whole(left)):
        sequence, times = (left, right) if isinstance(left, SEQUENCES) else (right, left)
        size, depth = budget.measure(sequence)
        return check_size(size * max(0, times)), depth
    if operator == "+" and isinstance(left, SEQUENCES) and isinstance(right, SEQUENCES):
        (left_size, left_depth), (right_size, right_depth) = budget.measure(left), budget.measure(right)
        return check_size(left_size + right_size), max(left_depth, right_depth)
    if operator == "%":
        _check_format(left, right)
    elif _whole(left) and _whole(right):
        bits = abs(left).bit_length()
        grown = bits + abs(right).bit_length() if operator == "*" else bits * right if operator == "**" else 0
        if grown > TEMPLATE_INT_BITS and abs(left) > 1:
            raise TemplateLimit(f"it made an integer of more than {TEMPLATE_INT_BITS:,} bits")
    return None


def _check_str_method(budget: Budget, owner: str, name: str, args: tuple, kwargs: dict) -> tuple:
    """Refuse a string method call that would make more than the size bound; the arguments to call it
    with (an iterable to join, as a list)."""
    first = args[0] if args else None
    if name in ("center", "ljust", "rjust", "zfill"):
        check_size(max(len(owner), _whole(first if args else kwargs.get("width"))))
    elif name == "expandtabs":
        check_size(len(owner) + owner.count("\t") * _whole(first if args else kwargs.get("tabsize", 8)))
    elif name == "replace" and len(args) >= 2:
        check_size(_replaced_size(owner, args[0], args[1], args[2] if len(args) > 2 else kwargs.get("count")))
    elif name == "join" and args:
        return (_joined(budget, first, owner),) + args[1:]
    elif name in ("format", "format_map"):
        _check_format(owner, args, kwargs)
    elif name == "translate" and isinstance(first, dict):
        longest = max((len(v) for v in first.values() if isinstance(v, str)), default=1)
        check_size(len(owner) * max(1, longest))
    return args


def _filter_checks(budget: Budget, name: str, args: list, kwargs: dict) -> list:
    """Refuse a built-in filter call that would make more than the size bound (or run a loop of its
    own that long); the arguments to call it with (``args[0]`` is the filtered value)."""
    value = args[0]

    def arg(index: int, key: str, default: Any = None) -> Any:
        return args[index] if len(args) > index else kwargs.get(key, default)

    if name == "center":
        check_size(max(budget.size(value), _whole(arg(1, "width", 80))))
    elif name == "indent":
        width = arg(1, "width", 4)
        step = len(width) if isinstance(width, str) else _whole(width)
        check_size(budget.size(value) + (str(value).count("\n") + 1) * step)
    elif name == "replace":
        check_size(_replaced_size(str(value), arg(1, "old", ""), arg(2, "new", ""), arg(3, "count")))
    elif name == "format":
        _check_format(value, args[1:], kwargs)
    elif name == "join":
        args[0] = _joined(budget, value, arg(1, "d", ""))
    elif name in ("batch", "slice"):
        check_size(_whole(arg(1, "linecount" if name == "batch" else "slices", 0)))
    elif name == "wordwrap":
        text = str(value)
        lines = len(text) // max(1, _whole(arg(1, "width", 79))) + text.count(" ") + text.count("\n") + 1
        check_size(len(text) + min(lines, len(text) + 1) * len(str(arg(3, "wrapstring") or "\n")))
    elif name == "round" and abs(_whole(arg(1, "precision", 0))) > 1000:
        raise TemplateLimit("it rounds to more than 1,000 digits")
    elif name == "tojson":
        indent = arg(2, "indent")
        width = len(indent) if isinstance(indent, str) else _whole(indent)
        spread = 2 + width * budget.depth(value) + sum(len(str(s)) for s in arg(3, "separators") or ())
        check_size(budget.size(value) * spread * (6 if arg(1, "ensure_ascii") else 1))
    return args


def _bounded_filter(name: str, function: Callable) -> Callable:
    """``function`` (the filter ``name``), counted: one step, its value sized, its arguments
    checked, its result counted."""
    offset = 1 if getattr(function, "jinja_pass_arg", None) is not None else 0

    @wraps(function)
    def bounded(*args: Any, **kwargs: Any) -> Any:
        budget = current()
        budget.tick()
        head, rest = list(args[:offset]), list(args[offset:])
        if rest:
            budget.size(rest[0])
            rest = _filter_checks(budget, name, rest, kwargs)
        return budget.made(function(*head, *rest, **kwargs))

    return bounded


@pass_environment
def _sum(environment, iterable: Any, attribute: Any = None, start: Any = 0) -> Any:
    """Jinja's ``sum``, for numbers only (adding lists one after another takes time quadratic in their
    length)."""
    budget = current()
    getter = make_attrgetter(environment, attribute) if attribute is not None else None
    total = start
    for item in budget.iterate(iterable):
        item = getter(item) if getter is not None else item
        if isinstance(item, bool) or not isinstance(item, (int, float)) or not isinstance(total, (int, float)):
            raise TypeError("the sum filter adds numbers")
        total += item
    return total


def _env_call(name: str, *args: nodes.Expr, lineno: int) -> nodes.Call:
    """A call of the environment's method ``name`` on ``args``, in the template's syntax tree."""
    call = nodes.Call(nodes.EnvironmentAttribute(name), list(args), [], None, None)
    return call.set_lineno(lineno)


class _Bounding(NodeTransformer):
    """Rewrites a parsed template so that its loops, concatenations, literals and text count."""

    def visit_For(self, node: nodes.For) -> nodes.Node:
        self.generic_visit(node)
        node.iter = _env_call("bounded_iter", node.iter, lineno=node.lineno)
        return node

    def visit_Concat(self, node: nodes.Concat) -> nodes.Node:
        self.generic_visit(node)
        return _env_call("bounded_concat", *node.nodes, lineno=node.lineno)

    def _literal(self, node: nodes.Expr) -> nodes.Node:
        self.generic_visit(node)
        if getattr(node, "ctx", "load") != "load":  # an assignment's targets
            return node
        return _env_call("bounded_value", node, lineno=node.lineno)

    visit_List = visit_Tuple = visit_Dict = _literal

    def visit_Output(self, node: nodes.Output) -> nodes.Node:
        self.generic_visit(node)
        node.nodes = [nodes.Const(child.data).set_lineno(child.lineno) if isinstance(child, nodes.TemplateData)
                      else child for child in node.nodes]  # counted by finalize, as every output piece
        return node

    def _other_file(self, node: nodes.Node) -> nodes.Node:
        statement = {nodes.Include: "include", nodes.Import: "import", nodes.FromImport: "from ... import",
                     nodes.Extends: "extends"}[type(node)]
        raise TemplateSyntaxError(f"{{% {statement} %}} needs another template file; a chat template is one file",
                                  node.lineno)

    visit_Include = visit_Import = visit_FromImport = visit_Extends = _other_file


class _BoundingCodeGenerator(CodeGenerator):
    def visit_Template(self, node: nodes.Template, frame=None) -> None:
        _Bounding().visit(node)
        super().visit_Template(node, frame)


def _internal(function: Callable) -> Callable:
    function.bounded_internal = True
    return function


@pass_context  # a finalize that takes the context is never applied at compile time: every piece counts
def _finalize(context, value: Any) -> Any:
    """Every output piece (``{{ ... }}`` and the template's own text): one step, sized and counted."""
    budget = current()
    budget.tick()
    return budget.made(value)


class BoundedSandbox(ImmutableSandboxedEnvironment):
    """Jinja's immutable sandbox with every render bounded (see the module's text)."""

    code_generator_class = _BoundingCodeGenerator
    intercepted_binops = frozenset({"+", "*", "%", "**"})

    def __init__(self, **options: Any):
        super().__init__(finalize=_finalize, **options)
        self.globals.pop("lipsum", None)  # runs its own loop, as long as asked
        self.filters["sum"] = _sum
        self.filters = {name: _bounded_filter(name, function) for name, function in self.filters.items()}

    def add_filters(self, filters: dict[str, Callable]) -> None:
        """Add ``filters``, bounded as the built-in ones."""
        self.filters.update({name: _bounded_filter(name, function) for name, function in filters.items()})

    # the compiled template's own calls
    @_internal
    def bounded_iter(self, iterable: Any) -> Iterator:
        return current().iterate(iterable)

    @_internal
    def bounded_concat(self, *parts: Any) -> str:
        budget = current()
        budget.tick()
        check_size(sum(budget.size(part) for part in parts))
        return budget.made("".join(str(part) for part in parts))

    @_internal
    def bounded_value(self, value: Any) -> Any:
        budget = current()
        budget.tick()
        return budget.made(value)

    # the sandbox's hooks
    def getattr(self, obj: Any, attribute: str) -> Any:
        current().tick()
        return super().getattr(obj, attribute)

    def getitem(self, obj: Any, argument: Any) -> Any:
        current().tick()
        return super().getitem(obj, argument)

    def call_binop(self, context, operator: str, left: Any, right: Any) -> Any:
        budget = current()
        budget.tick()
        known = _check_binop(budget, operator, left, right)
        result = super().call_binop(context, operator, left, right)
        return budget.remember(result, *known) if known is not None else budget.made(result)

    def call(__self, __context, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805 (Jinja's names)
        if type(__obj) is MethodType and __obj.__self__ is __self and hasattr(__obj.__func__, "bounded_internal"):
            kwargs.pop("_loop_vars", None)  # what Jinja passes every call inside a loop or a block
            kwargs.pop("_block_vars", None)
            return __obj(*args, **kwargs)
        budget = current()
        budget.tick()
        if isinstance(__obj, LoopContext) and args:  # a recursive loop's next level
            args = (budget.iterate(args[0]),) + args[1:]
        method = getattr(__obj, "__wrapped__", __obj)  # str.format comes wrapped by the sandbox
        owner = getattr(method, "__self__", None)
        if isinstance(owner, str):
            args = _check_str_method(budget, owner, getattr(method, "__name__", ""), args, kwargs)
        return budget.made(super().call(__context, __obj, *args, **kwargs))


def bounded_environment(**options: Any) -> BoundedSandbox:
    """A :class:`BoundedSandbox` with Jinja ``options`` (``trim_blocks``, ...)."""
    return BoundedSandbox(**options)
