"""Single built-in operations, checked before they run: what a call would make (repetition, padding,
replacing, joining, formatting widths, integer powers, ``to_bytes``, escaping, dates) against the
size bound, and what it would cost where its work grows faster than its input
(``encode('punycode')``, wrapping or stripping, sorting) against the scan and step bounds. A check
raises :class:`~slm_align.ondevice.templates.sandbox.budget.TemplateLimit`; otherwise the call runs,
with the arguments the check returns. Each check is arithmetic on the arguments (a count, a length),
never the operation itself.
"""

from __future__ import annotations

import codecs
import re
from functools import wraps
from typing import Any, Callable, Optional

from jinja2 import pass_environment
from jinja2.filters import make_attrgetter

from slm_align.ondevice.templates.sandbox.budget import (
    TEMPLATE_CHARS,
    TEMPLATE_INT_BITS,
    TEMPLATE_SCAN,
    Budget,
    TemplateLimit,
    check_size,
    current,
)

FORMAT_NUMBER = re.compile(r"\d+")
SEQUENCES = (str, list, tuple, bytes)
TEXT = (str, bytes)
CODECS = frozenset({"utf-8", "ascii", "iso8859-1", "utf-16", "utf-16-le", "utf-16-be", "utf-32",
                    "utf-32-le", "utf-32-be"})
"""The codecs ``encode`` and ``decode`` may use (by :func:`codecs.lookup`'s name): linear, at most 4
bytes a character. ``punycode`` and ``idna`` take time quadratic in the text (53 s on 20,000
characters), and the codec registry reaches further transforms: all refused."""
CODEC_ERRORS = frozenset({"strict", "ignore", "replace"})
"""Error handlers ``encode`` and ``decode`` may use (``namereplace`` writes up to 90 characters for
one)."""
STRFTIME_CHARS = 256
"""Characters of a ``strftime_now`` pattern (real templates pass ``'%d %b %Y'``)."""
STRFTIME_DIRECTIVE = re.compile(r"%([-_0^#]*)(\d*)(.?)", re.DOTALL)
URLIZE_CHARS = 100_000
"""Characters ``urlize`` may read: it runs regular expressions per word, about 4 µs a character."""
WRAP_STEPS = 4
"""Steps a word costs ``wordwrap`` (textwrap runs Python code per word and per space: about 3
µs)."""
WORD_START = re.compile(r"[-\s({\[<]+")
"""Where Jinja's ``title`` filter starts a word."""
ESCAPED_EXTRA = {"&": 4, "<": 3, ">": 3, '"': 4, "'": 4}
"""Characters HTML escaping adds for each of these (``&`` -> ``&amp;``)."""
SORTING = frozenset({"sort", "dictsort", "groupby"})
"""Filters that sort their value in Python: n log n steps."""
PER_ITEM = frozenset({"unique", "min", "max", "batch", "slice", "map", "select", "reject",
                      "selectattr", "rejectattr"})
"""Filters that run Python code per item of their value: a step each."""


def whole(value: Any) -> int:
    """An integer argument (a width, a count), else 0."""
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def check_scan(work: int, doing: str) -> None:
    """Refuse a call whose characters compared or copied (``work``) pass :data:`TEMPLATE_SCAN`."""
    if work > TEMPLATE_SCAN:
        raise TemplateLimit(f"it {doing}: more than {TEMPLATE_SCAN:,} "
                            "characters of work in one call")


def check_format(pattern: Any, args: Any, kwargs: Optional[dict] = None) -> None:
    """A printf or ``str.format`` pattern (text or bytes) whose widths or precisions would make more
    than the size bound: a number in the pattern, or a number argument (``%*d``, ``{:{}}``)."""
    if isinstance(pattern, bytes):
        pattern = pattern.decode("latin-1")
    if not isinstance(pattern, str):
        return
    if any(int(number) > TEMPLATE_CHARS for number in FORMAT_NUMBER.findall(pattern)):
        raise TemplateLimit(f"it formats a field wider than {TEMPLATE_CHARS:,} characters")
    values = list(args) if isinstance(args, (tuple, list)) else [args]
    values += list((kwargs or {}).values()) + (list(args.values()) if isinstance(args, dict)
                                               else [])
    if ("*" in pattern or "{" in pattern) and any(abs(whole(v)) > TEMPLATE_CHARS for v in values):
        raise TemplateLimit(f"it formats a field wider than {TEMPLATE_CHARS:,} characters")


def check_strftime(pattern: Any) -> None:
    """A date pattern of at most :data:`STRFTIME_CHARS` characters without field widths: ``%1000Y``
    pads the year to 1,000 characters (660,000 of them made 3.2 GB)."""
    if not isinstance(pattern, str):
        return
    if len(pattern) > STRFTIME_CHARS:
        raise TemplateLimit("it formats a date with a pattern of "
                            f"more than {STRFTIME_CHARS} characters")
    if any(match.group(2) for match in STRFTIME_DIRECTIVE.finditer(pattern)):
        raise TemplateLimit("it formats a date with a field width (such as %1000Y)")


def check_codec(method: str, args: tuple, kwargs: dict) -> None:
    """``encode`` or ``decode`` with a codec of :data:`CODECS` and an error handler of
    :data:`CODEC_ERRORS` only."""
    encoding = args[0] if args else kwargs.get("encoding", "utf-8")
    errors = args[1] if len(args) > 1 else kwargs.get("errors", "strict")
    if not isinstance(encoding, str):
        return  # the call itself refuses it
    try:
        name = codecs.lookup(encoding).name
    except LookupError:
        return
    if name not in CODECS:
        raise TemplateLimit(f"it calls {method}({encoding!r}); only utf-8, utf-16, utf-32, ascii "
                            "and latin-1 are allowed")
    if errors not in CODEC_ERRORS:
        raise TemplateLimit(f"it calls {method} with errors={errors!r}; only strict, ignore and "
                            "replace are allowed")


def replaced_size(text: Any, old: Any, new: Any, count: Any = None) -> int:
    """The length ``text.replace(old, new, count)`` would have (text or bytes)."""
    if isinstance(text, str):
        old, new = str(old), str(new)
    found = text.count(old) if old else len(text) + 1
    if count is not None and whole(count) >= 0:
        found = min(found, whole(count))
    return len(text) + found * max(0, len(new) - len(old))


def joined(budget: Budget, items: Any, separator: Any) -> list:
    """``items`` as a list (one step each), refused when joining them with ``separator`` would pass
    the size bound."""
    items = items if isinstance(items, (list, tuple)) else list(budget.iterate(items))
    check_size(budget.size(items) + len(str(separator)) * len(items))
    return list(items)


def check_binop(budget: Budget, operator: str, left: Any, right: Any) -> Optional[tuple[int, int]]:
    """Refuse ``left operator right`` when its result would pass a bound (checked before it is
    made); the result's (size, depth) when known from the operands."""
    if operator == "*" and (isinstance(left, SEQUENCES) and whole(right)
                            or isinstance(right, SEQUENCES) and whole(left)):
        sequence, times = (left, right) if isinstance(left, SEQUENCES) else (right, left)
        size, depth = budget.measure(sequence)
        return check_size(size * max(0, times)), depth
    if operator == "+" and isinstance(left, SEQUENCES) and isinstance(right, SEQUENCES):
        (left_size, left_depth), (right_size, right_depth) = budget.measure(left), budget.measure(right)
        return check_size(left_size + right_size), max(left_depth, right_depth)
    if operator == "%":
        check_format(left, right)
    elif whole(left) and whole(right):
        bits = abs(left).bit_length()
        grown = bits + abs(right).bit_length() if operator == "*" else bits * right if operator == "**" else 0
        if grown > TEMPLATE_INT_BITS and abs(left) > 1:
            raise TemplateLimit(f"it made an integer of more than {TEMPLATE_INT_BITS:,} bits")
    return None


def check_method(budget: Budget, owner: Any, name: str, args: tuple, kwargs: dict) -> tuple:
    """Refuse a method call of a string, bytes or integer that would pass a bound; the arguments to
    call it with (an iterable to join, as a list)."""
    if isinstance(owner, TEXT):
        return _check_text_method(budget, owner, name, args, kwargs)
    if isinstance(owner, int) and name == "to_bytes":
        check_size(whole(args[0] if args else kwargs.get("length", 1)))
    return args


def _check_text_method(budget: Budget, owner: Any, name: str, args: tuple, kwargs: dict) -> tuple:
    first = args[0] if args else None
    if name in ("center", "ljust", "rjust", "zfill"):
        check_size(max(len(owner), whole(first if args else kwargs.get("width"))))
    elif name == "expandtabs":
        tabs = owner.count("\t" if isinstance(owner, str) else b"\t")
        check_size(len(owner) + tabs * whole(first if args else kwargs.get("tabsize", 8)))
    elif name == "replace" and len(args) >= 2:
        check_size(replaced_size(owner, args[0], args[1],
                                 args[2] if len(args) > 2 else kwargs.get("count")))
    elif name == "join" and args:
        return (joined(budget, first, owner),) + args[1:]
    elif name in ("format", "format_map"):
        check_format(owner, args, kwargs)
    elif name == "translate" and isinstance(first, dict):
        longest = max((len(v) for v in first.values() if isinstance(v, str)), default=1)
        check_size(len(owner) * max(1, longest))
    elif name in ("encode", "decode"):
        check_codec(name, args, kwargs)
    elif name in ("strip", "lstrip", "rstrip"):
        chars = first if args else kwargs.get("chars")
        check_scan(len(owner) * len(chars) if isinstance(chars, TEXT) else 0, "strips a set "
                                                                              "of characters")
    elif name == "hex":
        check_size(3 * len(owner))
    return args


def _charge_items(budget: Budget, name: str, args: list) -> list:
    """A step per item of the value of a filter that runs Python code per item (n log2 n for one
    that sorts), charged before it runs; an unsized value is listed first, one step an item."""
    value = args[0]
    if not hasattr(value, "__len__"):
        value = args[0] = list(budget.iterate(value))
    items = len(value)
    budget.charge(items * max(1, items.bit_length()) if name in SORTING else items)
    return args


def check_filter(budget: Budget, name: str, args: list, kwargs: dict) -> list:
    """Refuse a built-in filter call that would pass a bound; the arguments to call it with
    (``args[0]`` is the filtered value)."""
    if name in SORTING or name in PER_ITEM:
        args = _charge_items(budget, name, args)
    check = FILTER_CHECKS.get(name)
    if check is not None:
        check(budget, FilterCall(args, kwargs))
    return args


class FilterCall:
    """A filter call's value (``args[0]``) and arguments, by position or by keyword."""

    def __init__(self, args: list, kwargs: dict):
        self.args = args
        self.kwargs = kwargs
        self.value = args[0]

    def arg(self, index: int, key: str, default: Any = None) -> Any:
        return self.args[index] if len(self.args) > index else self.kwargs.get(key, default)


def _center(budget: Budget, call: FilterCall) -> None:
    check_size(max(budget.size(call.value), whole(call.arg(1, "width", 80))))


def _indent(budget: Budget, call: FilterCall) -> None:
    width = call.arg(1, "width", 4)
    step = len(width) if isinstance(width, str) else whole(width)
    check_size(budget.size(call.value) + (str(call.value).count("\n") + 1) * step)


def _replace(budget: Budget, call: FilterCall) -> None:
    check_size(replaced_size(str(call.value), call.arg(1, "old", ""), call.arg(2, "new", ""),
                             call.arg(3, "count")))


def _format(budget: Budget, call: FilterCall) -> None:
    check_format(call.value, call.args[1:], call.kwargs)


def _join(budget: Budget, call: FilterCall) -> None:
    call.args[0] = joined(budget, call.value, call.arg(1, "d", ""))


def _batch_or_slice(budget: Budget, call: FilterCall) -> None:
    check_size(whole(call.arg(1, "linecount", call.kwargs.get("slices", 0))))


def _wordwrap(budget: Budget, call: FilterCall) -> None:
    """The wrapped text's size; textwrap's Python code per word (:data:`WRAP_STEPS` steps each); and
    its work on words longer than the width: it copies what is left of such a word for each line it
    cuts (``('a' * 10**6) | wordwrap(1)`` took 21 s)."""
    text = str(call.value)
    width = max(1, whole(call.arg(1, "width", 79)))
    lines = len(text) // width + text.count(" ") + text.count("\n") + 1
    check_size(len(text) + min(lines, len(text) + 1) * len(str(call.arg(3, "wrapstring") or "\n")))
    words = text.split()
    budget.charge(WRAP_STEPS * len(words))
    longest = max(map(len, words), default=0)
    if longest > width:
        check_scan(len(text) * longest // width, "wraps words longer than the width")


def _round(budget: Budget, call: FilterCall) -> None:
    if abs(whole(call.arg(1, "precision", 0))) > 1000:
        raise TemplateLimit("it rounds to more than 1,000 digits")


def _tojson(budget: Budget, call: FilterCall) -> None:
    """Its text's size; with an indent Python's own encoder runs, a step per item."""
    indent = call.arg(2, "indent")
    width = len(indent) if isinstance(indent, str) else whole(indent)
    spread = 2 + width * budget.depth(call.value) + sum(len(str(s))
                                                        for s in call.arg(3, "separators") or ())
    check_size(budget.size(call.value) * spread * (6 if call.arg(1, "ensure_ascii") else 1))
    if indent is not None:
        budget.charge(budget.size(call.value))


def _pprint(budget: Budget, call: FilterCall) -> None:
    """Python's pretty printer runs per item: a step each."""
    budget.charge(budget.size(call.value))


def _trim(budget: Budget, call: FilterCall) -> None:
    chars = call.arg(1, "chars")
    if isinstance(chars, str):
        check_scan(len(str(call.value)) * len(chars), "strips a set of characters")


def _escape(budget: Budget, call: FilterCall) -> None:
    text = str(call.value)
    check_size(len(text) + sum(text.count(char) * extra for char, extra in ESCAPED_EXTRA.items()))


def _urlencode(budget: Budget, call: FilterCall) -> None:
    if isinstance(call.value, str):
        check_size(3 * len(call.value.encode("utf-8", "surrogatepass")))


def _title(budget: Budget, call: FilterCall) -> None:
    """Jinja's ``title`` capitalises word by word in Python: three steps a word."""
    budget.charge(3 * len(WORD_START.findall(str(call.value))))


def _striptags(budget: Budget, call: FilterCall) -> None:
    """markupsafe's ``striptags`` cuts tags and unescapes entities one by one in Python: two steps
    each."""
    text = str(call.value)
    budget.charge(2 * (text.count("<") + text.count("&")))


def _urlize(budget: Budget, call: FilterCall) -> None:
    if len(str(call.value)) > URLIZE_CHARS:
        raise TemplateLimit(f"it urlizes more than {URLIZE_CHARS:,} characters")


FILTER_CHECKS: dict[str, Callable[[Budget, FilterCall], None]] = {
    "center": _center, "indent": _indent, "replace": _replace, "format": _format, "join": _join,
    "batch": _batch_or_slice, "slice": _batch_or_slice, "wordwrap": _wordwrap, "round": _round,
    "tojson": _tojson, "pprint": _pprint, "trim": _trim, "escape": _escape, "e": _escape,
    "forceescape": _escape, "urlencode": _urlencode, "urlize": _urlize, "title": _title,
    "striptags": _striptags,
}
"""The checks of the filters whose one call can make a large value or run long, by filter name."""


def bounded_filter(name: str, function: Callable) -> Callable:
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
            rest = check_filter(budget, name, rest, kwargs)
        return budget.made(function(*head, *rest, **kwargs))

    return bounded


@pass_environment
def bounded_sum(environment, iterable: Any, attribute: Any = None, start: Any = 0) -> Any:
    """Jinja's ``sum``, for numbers only (adding lists one after another takes time quadratic in
    their length)."""
    budget = current()
    getter = make_attrgetter(environment, attribute) if attribute is not None else None
    total = start
    for item in budget.iterate(iterable):
        item = getter(item) if getter is not None else item
        if isinstance(item, bool) or not isinstance(item, (int, float)) or not isinstance(total, (int, float)):
            raise TypeError("the sum filter adds numbers")
        total += item
    return total
