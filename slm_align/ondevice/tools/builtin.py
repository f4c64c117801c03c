"""Built-in tools for the on-device agent, safe by construction.

- :func:`calculator` evaluates arithmetic by walking the ``ast`` of a whitelisted grammar; it never
  calls ``eval`` or ``exec`` and bounds the size of every number it makes.
- :func:`current_time` reads the clock in an IANA time zone.
- :class:`NoteStore` keeps short text notes as files inside one folder, and nowhere else.

No shell, no network, no file access outside the notes folder. :func:`default_tools` bundles them.
"""

from __future__ import annotations

import ast
import math
import operator
import os
import re
import stat
from datetime import datetime
from datetime import timezone as dt_timezone
from pathlib import Path
from typing import Optional, Union
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from slm_align.atomic import write_text_atomic  # temporary file (created 0o600), then rename
from slm_align.errors import UserError
from slm_align.ondevice.tools.registry import ToolRegistry

# --- calculator ---------------------------------------------------------------------------------

MAX_EXPRESSION_CHARS = 500
MAX_INTEGER_BITS = 10_000  # about 3000 decimal digits
MAX_ROUND_DIGITS = math.ceil(MAX_INTEGER_BITS * math.log10(2))
"""round(x, n) with |n| past every digit a number here can have: CPython would compute 10**|n|
first."""

_FUNCTIONS = {
    **{name: getattr(math, name) for name in (
        "sqrt", "exp", "log", "log10", "log2", "sin", "cos", "tan", "asin", "acos", "atan", "atan2",
        "sinh", "cosh", "tanh", "hypot", "floor", "ceil", "fabs", "degrees", "radians",
    )},
    "abs": abs,
    "round": round,
    "min": min,
    "max": max,
}
_CONSTANTS = {"pi": math.pi, "e": math.e, "tau": math.tau, "inf": math.inf}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}

Number = Union[int, float]


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression, such as 2*(3+4)**2/7 or sqrt(2)*pi.

    Args:
        expression: Numbers, + - * / // % **, parentheses, the constants pi, e, tau and the
            functions sqrt, exp, log, log10, log2, sin, cos, tan, asin, acos, atan, atan2, sinh,
            cosh, tanh, hypot, floor, ceil, fabs, degrees, radians, abs, round, min, max.
    """
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"expression too long ({len(expression)} characters, limit "
                         f"{MAX_EXPRESSION_CHARS})")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ValueError(f"not an arithmetic expression: {expression!r}") from None
    return format_number(_evaluate(tree.body))


def format_number(value: Number) -> str:
    """An integer as is; a float with 12 significant digits, without ".0" when it is whole."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    return f"{value:.12g}" if isinstance(value, float) else str(value)


def _evaluate(node: ast.AST) -> Number:
    """The value of a whitelisted node; anything else is refused."""
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.Name) and node.id in _CONSTANTS:
        return _CONSTANTS[node.id]
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        return _checked(_BINARY[type(node.op)](_evaluate(node.left), _evaluate(node.right)))
    if isinstance(node, ast.Call):
        return _checked(_call(node))
    raise ValueError(f"{_describe(node)} is not allowed in a calculation; use numbers, + - * / // "
                     "% ** and parentheses")


def _call(node: ast.Call) -> Number:
    if not (isinstance(node.func, ast.Name) and node.func.id in _FUNCTIONS) or node.keywords:
        raise ValueError(f"only these functions can be called: {', '.join(_FUNCTIONS)}")
    if any(isinstance(arg, ast.Starred) for arg in node.args):
        raise ValueError("*arguments are not allowed in a calculation")
    arguments = [_evaluate(arg) for arg in node.args]
    _ARGUMENT_CHECKS.get(node.func.id, _no_check)(arguments)
    return _FUNCTIONS[node.func.id](*arguments)


def _no_check(arguments: list) -> None:
    """Functions whose work stays small for any number the calculator can make."""


def _check_round(arguments: list) -> None:
    """round's digits drive its work (it computes 10 to their power): bound them before calling."""
    if len(arguments) == 2 and isinstance(arguments[1], int) and abs(arguments[1]) > MAX_ROUND_DIGITS:
        raise ValueError(f"round takes at most {MAX_ROUND_DIGITS} digits either side of the point, "
                         f"got {format_number(arguments[1])[:20]}")


_ARGUMENT_CHECKS = {"round": _check_round}


def _power(base: Number, exponent: Number) -> Number:
    """``base ** exponent``, refused before it is computed when the integer result would be huge."""
    exact = isinstance(base, int) and isinstance(exponent, int) and exponent > 0 and abs(base) > 1
    if exact and exponent * math.log2(abs(base)) > MAX_INTEGER_BITS:
        raise ValueError(f"result too large: {base}**{exponent} "
                         f"has more than {MAX_INTEGER_BITS} bits")
    try:
        return base ** exponent
    except OverflowError:
        raise ValueError("result too large: "
                         f"{format_number(base)}**{format_number(exponent)}") from None


_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: _power,
}


def _checked(value: object) -> Number:
    """Refuse complex results and integers past the size bound."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError("the result is not a real number")
    if isinstance(value, int) and value.bit_length() > MAX_INTEGER_BITS:
        raise ValueError(f"result too large (more than {MAX_INTEGER_BITS} bits)")
    return value


def _describe(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return f"the name {node.id!r} (known constants: {', '.join(_CONSTANTS)})"
    if isinstance(node, ast.Constant):
        return f"the constant {node.value!r}"
    return f"'{ast.unparse(node)[:40]}' ({type(node).__name__})"


# --- clock --------------------------------------------------------------------------------------


def current_time(timezone: str = "UTC") -> str:
    """The current date, time and weekday in a time zone.

    Args:
        timezone: An IANA time zone name such as "Europe/Paris" or "America/New_York".
    """
    return time_text(datetime.now(dt_timezone.utc), timezone)


def time_text(moment: datetime, timezone: str) -> str:
    """``moment`` in ``timezone`` as :func:`current_time` writes it: ISO date and time, weekday,
    zone."""
    local = moment.astimezone(_zone(timezone))
    return f"{local.isoformat(timespec='seconds')} ({local:%A}, {timezone})"


def _zone(name: str):
    if name.strip().upper() == "UTC":  # needs no tz database, which small boards may lack
        return dt_timezone.utc
    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError, OSError):
        raise ValueError(f"unknown time zone {name!r}; use an IANA name "
                         "such as 'Europe/Paris', or 'UTC'") from None


# --- notes --------------------------------------------------------------------------------------

MAX_TITLE_CHARS = 60
_UNSAFE_TITLE_CHARS = re.compile(r"[^\w .,()-]")
_NOTE_SUFFIX = ".txt"


class NoteStore:
    """Short text notes, one ``<title>.txt`` file each, inside ``folder`` and nowhere else.

    Titles are plain names: characters other than letters, digits, space and ``.,()-_`` become
    ``_``; a title that looks like a path (``/``, ``\\``, a leading ``.``), holds a NUL byte, or
    names a file that resolves outside the folder (a symlink) is refused. Notes are written
    atomically with mode 0o600.

    Args:
        folder: The notes folder; created (mode 0o700) if missing.
        max_note_chars: Longest note text accepted.
        max_notes: Most notes the folder may hold.
    """

    def __init__(self, folder: Union[str, Path], max_note_chars: int = 10_000,
                 max_notes: int = 1000):
        path = Path(folder).expanduser()
        try:
            path.mkdir(mode=0o700, parents=True, exist_ok=True)
        except (FileExistsError, NotADirectoryError):
            raise UserError(f"notes folder {str(path)!r} is not a "
                            "directory: pass a folder path") from None
        self.folder = path.resolve()
        self.max_note_chars = max_note_chars
        self.max_notes = max_notes

    def save_note(self, title: str, text: str) -> str:
        """Save a note under a title, replacing any note with the same title.

        Args:
            title: A short plain name for the note, such as "shopping list".
            text: The note's text.
        """
        path = self._path(title)
        if len(text) > self.max_note_chars:
            raise ValueError(f"note too long ({len(text)} characters, limit {self.max_note_chars})")
        if not path.exists() and len(self.list_notes()) >= self.max_notes:
            raise ValueError(f"the notes folder is full ({self.max_notes} "
                             "notes); overwrite an existing note")
        write_text_atomic(path, text)
        return f"saved note {path.stem!r} ({len(text)} characters)"

    def read_note(self, title: str) -> str:
        """Read the note saved under a title.

        Args:
            title: The note's title, as given to save_note or listed by list_notes.
        """
        path = self._path(title)
        flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
        try:
            fd = os.open(path, flags)
        except FileNotFoundError:
            saved = ", ".join(self.list_notes()) or "none"
            raise ValueError(f"no note titled {title!r}; saved notes: {saved}") from None
        with os.fdopen(fd, encoding="utf-8", errors="replace") as handle:
            if not stat.S_ISREG(os.fstat(handle.fileno()).st_mode):
                raise ValueError(f"note {title!r} is not a regular file; refused")
            return handle.read(self.max_note_chars)

    def list_notes(self) -> list[str]:
        """List the titles of the saved notes."""
        return sorted(
            path.stem for path in self.folder.glob(f"*{_NOTE_SUFFIX}") if not path.is_symlink() and path.is_file()
        )

    def _path(self, title: str) -> Path:
        """The file for ``title``, or ValueError when the title is unsafe or resolves outside the
        folder."""
        name = _clean_title(title)
        path = self.folder / f"{name}{_NOTE_SUFFIX}"
        if path.is_symlink() or path.resolve().parent != self.folder:
            raise ValueError(f"note {title!r} points outside the notes folder; refused")
        return path


def _clean_title(title: str) -> str:
    """``title`` as a safe file name stem; ValueError for NUL bytes, paths, empty or long titles."""
    if "\x00" in title:
        raise ValueError("a note title cannot contain a NUL byte")
    clean = title.strip()
    if not clean:
        raise ValueError("a note title cannot be empty")
    if "/" in clean or "\\" in clean or clean.startswith(".") or os.path.isabs(clean):
        raise ValueError(f"note title {title!r} looks like a path; use a plain name such as "
                         "'shopping list'")
    if len(clean) > MAX_TITLE_CHARS:
        raise ValueError(f"note title too long ({len(clean)} characters, limit {MAX_TITLE_CHARS})")
    return _UNSAFE_TITLE_CHARS.sub("_", clean)


# --- the bundle ---------------------------------------------------------------------------------


def default_tools(notes_folder: Optional[Union[str, Path]] = None) -> ToolRegistry:
    """A registry with calculator and current_time, plus save_note/read_note/list_notes when a
    folder is given."""
    registry = ToolRegistry()
    registry.register(calculator)
    registry.register(current_time)
    if notes_folder is not None:
        store = NoteStore(notes_folder)
        for method in (store.save_note, store.read_note, store.list_notes):
            registry.register(method)
    return registry
