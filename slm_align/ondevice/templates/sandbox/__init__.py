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

A single built-in operation is not interrupted, so each is checked before it runs
(:mod:`slm_align.ondevice.templates.sandbox.checks`): what it would make against the size bound
(padding, ``to_bytes``, escaping, a date pattern's field widths), and, where its work grows faster
than its input, what it would cost: ``encode``/``decode`` take linear codecs only (``punycode`` is
quadratic), wrapping long words and stripping with a set of characters are bounded in characters
scanned (:data:`TEMPLATE_SCAN`), and filters that run Python code per item (``sort``, ``unique``,
``map``, ...) take a step per item (n log n for a sort) before they start. A render so ends within
about :data:`TEMPLATE_SECONDS` plus one such operation (about a second at most).

The package: :mod:`~slm_align.ondevice.templates.sandbox.budget` (the bounds, a render's allowance),
:mod:`~slm_align.ondevice.templates.sandbox.checks` (single operations), and here the environment
and the code generator.
"""

from __future__ import annotations

from types import MethodType
from typing import Any, Callable, Iterator

from jinja2 import nodes, pass_context
from jinja2.compiler import CodeGenerator
from jinja2.exceptions import TemplateSyntaxError
from jinja2.runtime import LoopContext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.visitor import NodeTransformer

from slm_align.ondevice.templates.sandbox.budget import (
    TEMPLATE_CHARS,
    TEMPLATE_INT_BITS,
    TEMPLATE_SCAN,
    TEMPLATE_SECONDS,
    TEMPLATE_STEPS,
    TEMPLATE_WORK_CHARS,
    Budget,
    TemplateLimit,
    budgeted,
    check_size,
    current,
)
from slm_align.ondevice.templates.sandbox.checks import (
    bounded_filter,
    bounded_sum,
    check_binop,
    check_method,
)

__all__ = ["TEMPLATE_CHARS", "TEMPLATE_INT_BITS", "TEMPLATE_SCAN", "TEMPLATE_SECONDS",
           "TEMPLATE_STEPS", "TEMPLATE_WORK_CHARS", "Budget", "BoundedSandbox", "TemplateLimit",
           "bounded_environment", "budgeted", "current", "render_bounded"]


def render_bounded(template, variables: dict) -> str:
    """``template`` (compiled by a :class:`BoundedSandbox`) rendered with ``variables`` under a
    fresh budget; a TemplateLimit past a bound."""
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
        node.nodes = [nodes.Const(child.data).set_lineno(child.lineno)
                      if isinstance(child, nodes.TemplateData)
                      # counted by finalize, as every output piece
                      else child for child in node.nodes]
        return node

    def _other_file(self, node: nodes.Node) -> nodes.Node:
        statement = {nodes.Include: "include", nodes.Import: "import", nodes.FromImport: "from ... "
                                                                                         "import",
                     nodes.Extends: "extends"}[type(node)]
        raise TemplateSyntaxError(f"{{% {statement} %}} needs another template file; a chat "
                                  "template is one file",
                                  node.lineno)

    visit_Include = visit_Import = visit_FromImport = visit_Extends = _other_file


class _BoundingCodeGenerator(CodeGenerator):
    def visit_Template(self, node: nodes.Template, frame=None) -> None:
        _Bounding().visit(node)
        super().visit_Template(node, frame)


def _internal(function: Callable) -> Callable:
    function.bounded_internal = True
    return function


# a finalize that takes the context is never applied at compile time: every piece counts
@pass_context
def _finalize(context, value: Any) -> Any:
    """Every output piece (``{{ ... }}`` and the template's own text): one step, sized and
    counted."""
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
        self.filters["sum"] = bounded_sum
        self.filters = {name: bounded_filter(name, function)
                        for name, function in self.filters.items()}

    def add_filters(self, filters: dict[str, Callable]) -> None:
        """Add ``filters``, bounded as the built-in ones."""
        self.filters.update({name: bounded_filter(name, function)
                             for name, function in filters.items()})

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
        known = check_binop(budget, operator, left, right)
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
        if owner is not None:
            args = check_method(budget, owner, getattr(method, "__name__", ""), args, kwargs)
        return budget.made(super().call(__context, __obj, *args, **kwargs))


def bounded_environment(**options: Any) -> BoundedSandbox:
    """A :class:`BoundedSandbox` with Jinja ``options`` (``trim_blocks``, ...)."""
    return BoundedSandbox(**options)
