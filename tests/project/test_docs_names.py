"""Words that match the code: every ``--flag`` that README.md, docs/ and the commands' ``--help`` texts show
with an ``slm-align`` command exists on that command, every reward named by ``--reward`` (or a Python
``rewards=``) is in the reward registry, and every device profile named by a profile's ``--device`` (or
``devices show``) is a bundled profile.

Command lines are read from shell code blocks and inline code spans (a line continued with ``\\`` is one
line; ``&&``, ``;`` and ``|`` separate commands); the option names come from the click commands Typer
builds, never from a list kept here.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Iterator, Optional

import pytest
import typer

ROOT = Path(__file__).resolve().parents[2]
FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})\s*([\w+-]*)")
INLINE_CODE = re.compile(r"(`+)((?:(?!\n[ \t]*\n).)+?)\1", re.DOTALL)
SHELL_FENCES = {"", "bash", "sh", "shell", "console", "zsh", "text"}
SEPARATORS = re.compile(r"\s(?:&&|\|\||;|\|)\s")
LAUNCHERS = {"nohup", "time", "exec", "uv", "run", "uvx", "sudo", "$", "-"}
"""Words that may come before ``slm-align`` on a command line (``nohup slm-align ...``, ``$ slm-align``)."""
PLACEHOLDER = re.compile(r"^[A-Z][A-Z0-9_]*$|[<>\[\]{}]|\.\.\.|^CMD$")
REWARD_FLAGS = ("--reward",)
PYTHON_REWARDS = re.compile(r"""(?<![\w.])rewards?\s*=\s*\[?\s*((?:["'][\w@.:]+["']\s*,?\s*)+)""")


Command = Any
"""A click command or group as Typer builds it (Typer vendors its own click: typed loosely here)."""


@dataclass(frozen=True)
class Mention:
    """One ``slm-align`` command line found in a text: where, the tokens after ``slm-align``."""

    where: str
    tokens: tuple[str, ...]
    comment: str = ""


def root_command() -> Command:
    from slm_align.cli import app

    return typer.main.get_command(app)


def commands(group: Command, path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], Command]]:
    """Every command and group under ``group`` with its path (``("devices", "fit")``)."""
    yield path, group
    for name, sub in getattr(group, "commands", {}).items():
        yield from commands(sub, path + (name,))


def option_names(command: Command) -> set[str]:
    """The long and short option names a command accepts (``--x/--no-x`` both), ``--help`` included."""
    names = {"--help"}
    for param in command.params:
        if param.param_type_name == "option":
            names.update(param.opts)
            names.update(param.secondary_opts)
    return names


def blocks(text: str) -> Iterator[tuple[int, str, bool]]:
    """(line number, shell text, inline) of a Markdown page: each line of a shell fence (continuations
    joined), and each inline code span outside fences."""
    lines = text.split("\n")
    fence, language, joined, start = None, "", "", 0
    prose = []
    for number, line in enumerate(lines, start=1):
        opened = FENCE.match(line)
        if fence is None and opened:
            fence, language = opened.group(1), opened.group(2).lower()
            prose.append("")
            continue
        if fence is not None:
            if line.strip().startswith(fence) and set(line.strip()) == {fence[0]}:
                fence = None
            elif language in SHELL_FENCES:
                joined, start = (joined + " " + line, start) if joined else (line, number)
                if not line.rstrip().endswith("\\"):
                    yield start, joined, False
                    joined = ""
                else:
                    joined = joined.rstrip()[:-1]
            prose.append("")
            continue
        prose.append(line)
    body = "\n".join(prose)
    for match in INLINE_CODE.finditer(body):
        yield body.count("\n", 0, match.start()) + 1, " ".join(match.group(2).split()), True


def comment_split(line: str) -> tuple[str, str]:
    """A shell line and its ``# comment`` (a ``#`` that starts a word), apart."""
    parts = re.split(r"(?:^|\s)#", line, maxsplit=1)
    return parts[0], parts[1] if len(parts) > 1 else ""


def split_words(text: str) -> list[str]:
    try:
        return shlex.split(text)
    except ValueError:  # an unbalanced quote in prose: words will do
        return text.split()


def mentions(text: str, where: str, names: frozenset = frozenset()) -> Iterator[Mention]:
    """Every ``slm-align ...`` command in ``text`` (a Markdown page or a help text); with ``names`` (the
    top-level commands), also a code span that starts with one of them and shows a flag (``export --target``)."""
    for line, shell, inline in blocks(text):
        command, comment = comment_split(shell)
        for part in SEPARATORS.split(" " + command + " "):
            words = split_words(part)
            if inline and words and words[0] in names and any(word.startswith("--") for word in words):
                words = ["slm-align", *words]
            if "slm-align" not in words:
                continue
            at = words.index("slm-align")
            if all("=" in word or word in LAUNCHERS for word in words[:at]):
                yield Mention(f"{where}:{line}", tuple(words[at + 1:]), comment)


def resolve(tokens: tuple[str, ...], root: Command) -> tuple[Optional[Command], tuple[str, ...], list[str]]:
    """The command the tokens name (None when a placeholder or an unknown word stands for it), its path,
    and the problems of the words that pick it."""
    command, path = root, ()
    for token in tokens:
        if not hasattr(command, "commands"):
            break
        if token.startswith("-"):  # an option of the group (``slm-align --quiet train``)
            continue
        sub = command.commands.get(token)
        if sub is None:
            if PLACEHOLDER.search(token) or "|" in token:  # ``feedback export|collect``, ``slm-align ...``
                return None, path, []
            return None, path, [f"slm-align {' '.join(path + (token,))}: no such command"]
        command, path = sub, path + (token,)
    return command, path, []


def flags(tokens: tuple[str, ...]) -> list[str]:
    """The ``--flag`` words of a command line, without values, up to a bare ``--``."""
    found = []
    for token in tokens:
        if token == "--":
            break
        if token.startswith("--") and len(token) > 2:
            found.append(token.split("=", 1)[0])
    return found


def values(tokens: tuple[str, ...], flag: str) -> list[str]:
    """The values given to ``flag`` (``--flag V`` or ``--flag=V``)."""
    found = []
    for index, token in enumerate(tokens):
        if token == flag and index + 1 < len(tokens):
            found.append(tokens[index + 1])
        elif token.startswith(flag + "="):
            found.append(token.split("=", 1)[1])
    return found


def flag_problems(mention: Mention, root: Command) -> list[str]:
    """Why a command line names a command or flag that does not exist (empty when all exist)."""
    command, path, problems = resolve(mention.tokens, root)
    if command is None:
        return [f"{mention.where}: {problem}" for problem in problems]
    allowed = option_names(command) | option_names(root)
    if "deprecated" in mention.comment:  # an old spelling shown as one, with its note
        allowed |= set(deprecated(path))
    shown = f"slm-align {' '.join(path)}".strip()
    for flag in flags(mention.tokens):
        if flag not in allowed and not PLACEHOLDER.search(flag):
            problems.append(f"{shown} has no {flag}")
    return [f"{mention.where}: {problem}" for problem in problems]


def deprecated(path: tuple[str, ...]) -> dict[str, str]:
    """The old spellings a command still accepts with a note (old -> new)."""
    from slm_align.cli.aliases import DEPRECATED

    return DEPRECATED.get(" ".join(path), {})


def profile_flag(command: Optional[Command]) -> bool:
    """Whether the command's ``--device`` names a device profile (not a torch device)."""
    for param in getattr(command, "params", ()):
        if "--device" in getattr(param, "opts", ()):
            return "profile" in (param.help or "").lower()
    return False


def reward_names(mention: Mention) -> list[str]:
    """Built-in reward names a command line gives ``--reward`` (weights dropped; ``module:function``
    and placeholders left out)."""
    names = []
    for flag in REWARD_FLAGS:
        for value in values(mention.tokens, flag):
            name = value.split("@", 1)[0]
            if ":" not in name and not PLACEHOLDER.search(name) and not name.endswith(".py"):
                names.append(name)
    return names


def profile_names(mention: Mention, root: Command) -> list[str]:
    """Device profile names a command line gives: a profile ``--device``, ``devices show NAME``."""
    command, path, _ = resolve(mention.tokens, root)
    names = values(mention.tokens, "--device") if profile_flag(command) else []
    if path == ("devices", "show"):
        rest = [token for token in mention.tokens[2:] if not token.startswith("-")]
        names += rest[:1]
    return [name for name in names if not PLACEHOLDER.search(name)]


def markdown_pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def help_texts(root: Command) -> Iterator[tuple[str, tuple[str, ...], str]]:
    """(where, command path, text) of every help text: a command's help and epilog, each option's help."""
    for path, command in commands(root):
        name = " ".join(("slm-align",) + path)
        yield f"{name} --help", path, f"{command.help or ''}\n\n{command.epilog or ''}"
        for param in command.params:
            if getattr(param, "help", None):
                yield f"{name} {param.opts[0]} help", path, param.help


def bare_flags(text: str, names: frozenset = frozenset()) -> list[str]:
    """``--flag`` words of a help text outside its command examples (``slm-align ...`` lines, and code spans
    that start with a command of ``names``)."""
    cleaned = []
    for line in text.split("\n"):
        line = re.sub(r"`([^`]*)`", partial(_unless_command, names), line)
        cleaned.append(line.split("slm-align", 1)[0])
    return re.findall(r"(?<![\w-])(--[a-z][\w-]*)", "\n".join(cleaned))


def _unless_command(names: frozenset, span: re.Match) -> str:
    """A code span as it is, or blanked when it is a command line (``slm-align ...``, ``export --target``)."""
    words = span.group(1).split()
    return " " if words and (words[0] == "slm-align" or words[0] in names) else span.group(0)


def all_mentions(root: Command) -> list[Mention]:
    """The command lines of every page and help text."""
    names = frozenset(root.commands)
    found = []
    for page in markdown_pages():
        found += mentions(page.read_text(encoding="utf-8"), str(page.relative_to(ROOT)), names)
    for where, _, text in help_texts(root):
        found += [Mention(where, m.tokens, m.comment) for m in mentions(_as_code(text), where, names)]
    return found


def _as_code(help_text: str) -> str:
    """A help text as Markdown whose every line is code (an epilog's example has no backticks)."""
    return "```bash\n" + help_text.replace("\n\n", "\n") + "\n```\n" + help_text


@pytest.fixture(scope="module")
def root() -> Command:
    return root_command()


def test_every_flag_shown_with_a_command_exists_on_it(root):
    found = all_mentions(root)
    assert len(found) > 100  # the pages and help texts do show commands
    problems = sorted({problem for mention in found for problem in flag_problems(mention, root)})
    assert not problems, "\n".join(problems)


def test_every_flag_a_help_text_names_is_the_commands_own(root):
    problems = []
    for where, path, text in help_texts(root):
        command = dict(commands(root))[path]
        allowed = option_names(command) | option_names(root) | set(deprecated(path))  # "(was --model)"
        problems += [f"{where}: {flag}" for flag in bare_flags(text, frozenset(root.commands)) if flag not in allowed]
    assert not problems, "\n".join(problems)


def test_every_reward_named_is_in_the_registry(root):
    from slm_align.ondevice.rewards.builtin import BUILTINS

    named: dict[str, set[str]] = {}
    for mention in all_mentions(root):
        for name in reward_names(mention):
            named.setdefault(name, set()).add(mention.where)
    for page in markdown_pages():
        for match in PYTHON_REWARDS.finditer(page.read_text(encoding="utf-8")):
            for name in re.findall(r"""["']([\w@.:]+)["']""", match.group(1)):
                if ":" not in name:
                    named.setdefault(name.split("@", 1)[0], set()).add(str(page.relative_to(ROOT)))
    assert {"task_success", "tool_task"} <= set(named)  # the check reads what the docs show
    unknown = {name: sorted(where) for name, where in named.items() if name not in BUILTINS}
    assert not unknown, unknown


def test_every_device_profile_named_exists(root):
    from slm_align.ondevice.devices import list_profiles

    profiles = set(list_profiles())
    named: dict[str, set[str]] = {}
    for mention in all_mentions(root):
        for name in profile_names(mention, root):
            named.setdefault(name, set()).add(mention.where)
    assert {"rpi5", "iphone-15-pro"} <= set(named)
    unknown = {name: sorted(where) for name, where in named.items() if name not in profiles}
    assert not unknown, unknown


def test_the_checker_catches_a_planted_unknown_flag_reward_and_profile(root):
    """The checks above would pass vacuously if they found nothing: a page with one wrong name of each kind."""
    page = ("# Page\n\n```bash\nslm-align train --data d.txt \\\n    --no-such-flag 3 --reward no_such_reward\n"
            "slm-align devices fit m.gguf --device no-such-phone   # a comment --not-a-flag\n```\n\n"
            "Inline: `slm-align export runs/x --target gguf --quant Q8_0 --bogus`, "
            "`slm-align tarin --data x`, `pip install slm-align[agent]`, `merge --no-merge`.\n\n"
            "```\nmerge -> export --quant Q8_0   (a diagram: no command)\n```\n")
    found = list(mentions(page, "page.md", frozenset(root.commands)))
    assert [m.tokens[0] for m in found] == ["train", "devices", "export", "tarin", "merge"]
    problems = [problem for mention in found for problem in flag_problems(mention, root)]
    assert problems == ["page.md:4: slm-align train has no --no-such-flag",
                        "page.md:9: slm-align export has no --bogus",
                        "page.md:9: slm-align tarin: no such command",
                        "page.md:9: slm-align merge has no --no-merge"]
    assert reward_names(found[0]) == ["no_such_reward"]
    assert profile_names(found[1], root) == ["no-such-phone"]
    assert flag_problems(Mention("x", ("train", "--data", "d", "--", "--anything")), root) == []
    assert bare_flags("Use --force; see `slm-align export --quant F16`.") == ["--force"]


def test_option_names_come_from_the_commands(root):
    fit = dict(commands(root))[("devices", "fit")]
    assert {"--device", "--quant", "--json", "--help"} <= option_names(fit)
    assert "--reward" not in option_names(fit) and profile_flag(fit)


def test_the_calculator_task_is_trained_on_one_reward_everywhere(root):
    """README and docs/tool-use.md show the same worked example the quickstart runs: one reward name for it
    (the README said task_success where docs/tool-use.md said tool_task): the calculator's 0/1 reward."""
    REWARD = "task_success"

    shown = {}
    for mention in all_mentions(root):
        if mention.tokens[:1] == ("train",) and "data/calc/train.jsonl" in values(mention.tokens, "--tasks"):
            shown[mention.where] = reward_names(mention)[:1]
    assert any(where.startswith("README.md") for where in shown) and any("tool-use" in where for where in shown)
    assert {where: names for where, names in shown.items() if names != [REWARD]} == {}


def test_every_package_path_the_docs_name_exists():
    """``slm_align/config.py`` stayed in the docs after config became a package: a path under slm_align/
    in README.md or docs/ names a file or folder that is there (a ``*`` matches as a glob)."""
    missing = []
    for page in markdown_pages():
        for match in re.finditer(r"`(slm_align/[\w/.*-]+)", page.read_text(encoding="utf-8")):
            path = match.group(1).rstrip(".")
            if not (list(ROOT.glob(path)) if "*" in path else (ROOT / path).exists()):
                missing.append(f"{page.relative_to(ROOT)}: {path}")
    assert not missing, "\n".join(missing)


def test_the_reward_table_lists_exactly_the_registry():
    from slm_align.ondevice.rewards.builtin import BUILTINS

    page = (ROOT / "docs" / "reward-functions.md").read_text(encoding="utf-8")
    table = page.split("| built-in |", 1)[1].split("\n\n", 1)[0]
    assert re.findall(r"^\| `(\w+)` \|", table, flags=re.MULTILINE) == list(BUILTINS)


def test_the_shipping_table_names_every_profile_and_the_type_they_pick():
    """docs/shipping.md's "which to pick" table names the profiles per kind of device and says the GGUF
    type the profiles pick for a merged export."""
    from slm_align.ondevice.devices import list_profiles, load_profile
    from slm_align.ondevice.devices.estimate import preferred_quant

    page = (ROOT / "docs" / "shipping.md").read_text(encoding="utf-8")
    table = page.split("| device | GGUF", 1)[1].split("\n\n", 1)[0]
    named = [name for group in re.findall(r"^\| [\w /]+ \(([\w, -]+)\)", table, flags=re.MULTILINE)
             for name in group.split(", ")]
    assert sorted(named) == sorted(list_profiles())
    picked = {preferred_quant(load_profile(name)) for name in named if load_profile(name).runtime == "gguf"}
    assert picked == set(re.findall(r"a merged export: `(\w+)`, the profiles' type", table))
