"""Old spellings of flags: rewritten to today's before the parser sees them, each with
a one-line note on stderr.

One spelling per concept across commands: ``--max-new-tokens`` (not ``--max-tokens``), ``--ctx``
(not ``--context``), ``--model`` a base model everywhere (``evaluate`` names its extra policies
``--baseline``). The spellings users know from TRL and llama.cpp (``--num-generations``,
``--max-completion-length``, ``--output-dir``, ``--ctx-size``, ...) are plain aliases declared
beside each option: they are not deprecated and print nothing.
"""

from __future__ import annotations

from typing import Callable

DEPRECATED: dict[str, dict[str, str]] = {
    "chat": {"--max-tokens": "--max-new-tokens"},
    "evaluate-agent": {"--max-tokens": "--max-new-tokens"},
    "evaluate": {"--model": "--baseline", "-m": "--baseline"},
    "devices fit": {"--context": "--ctx"},
}
"""Per command (as typed after ``slm-align``): old spelling -> today's."""


def _renames(argv: list[str]) -> dict[str, str]:
    """The deprecated spellings of the command ``argv`` starts with (a group's
    subcommand is two words)."""
    for words in (2, 1):
        command = " ".join(argv[:words])
        if command in DEPRECATED:
            return DEPRECATED[command]
    return {}


def _renamed(token: str, renames: dict[str, str]) -> tuple[str, str]:
    """``token`` in today's spelling (``--max-tokens=9`` -> ``--max-new-tokens=9``), and the
    old flag ("" if none)."""
    flag, equals, value = token.partition("=")
    if flag not in renames:
        return token, ""
    return renames[flag] + equals + value, flag


def current_spellings(argv: list[str], note: Callable[[str], None]) -> list[str]:
    """``argv`` with each deprecated flag of its command replaced by today's spelling; ``note`` gets
    one line per old flag used. Nothing after ``--`` is touched."""
    renames = _renames(argv)
    if not renames:
        return list(argv)
    rewritten: list[str] = []
    noted: set[str] = set()
    for index, token in enumerate(argv):
        if token == "--":
            return rewritten + list(argv[index:])
        current, old = _renamed(token, renames)
        if old and old not in noted:
            noted.add(old)
            note(f"note: {old} is deprecated; use {renames[old]}\n")
        rewritten.append(current)
    return rewritten
