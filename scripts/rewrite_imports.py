"""Rewrite old slm_align module paths to the issue-46 tree, over a whole checkout.

    python scripts/rewrite_imports.py /path/to/checkout [--dry-run]
    python scripts/rewrite_imports.py --self-test

Rewrites dotted paths (``import``/``from`` lines, strings such as monkeypatch targets
"slm_align.x.y", docs) and slash paths (``slm_align/x/y.py``, ``agent/runtime.py`` in prose) in
*.py, *.md, *.toml, *.txt, *.cfg, *.ini, *.yml, *.yaml, *.sh files, except .git, virtual
environments and this script. A move applies only once its new module exists in the checkout,
so the script can run before, between and after the ``git mv`` steps. Idempotent: a path that
already starts with a new module is left alone, so a second run changes nothing.

Names that moved out of a module (``recipe_from_sft`` out of the SFT stage, the gate's types out
of the headroom stage, the re-exports dropped from agent/sampling.py) are moved in
``from M import a, b`` statements (split in two when only some names moved) and in dotted strings.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

MOVES = {
    # the device wing, one visible part
    "slm_align.agent": "slm_align.ondevice.agent",
    "slm_align.tools": "slm_align.ondevice.tools",
    "slm_align.rewards": "slm_align.ondevice.rewards",
    "slm_align.devices": "slm_align.ondevice.devices",
    "slm_align.ab_test": "slm_align.ondevice.agent.ab_sequential",
    # chat templates in one place
    "slm_align.chat_templates": "slm_align.ondevice.templates.chat",
    "slm_align.template_sandbox": "slm_align.ondevice.templates.sandbox",
    "slm_align.agent.template": "slm_align.ondevice.templates.artifact",
    # every GGUF reader and writer
    "slm_align.gguf_adapters": "slm_align.ondevice.gguf.adapter_check",
    "slm_align.gguf_cache": "slm_align.ondevice.gguf.cache",
    "slm_align.gguf_fields": "slm_align.ondevice.gguf.fields",
    "slm_align.gguf_tokenizer": "slm_align.ondevice.gguf.tokenizer",
    "slm_align.export.gguf": "slm_align.ondevice.gguf.writer",
    "slm_align.export.gguf_adapter": "slm_align.ondevice.gguf.adapter_writer",
    "slm_align.export.gguf_arch": "slm_align.ondevice.gguf.architectures",
    "slm_align.export.gguf_vocab": "slm_align.ondevice.gguf.vocab",
    # config helpers inside config/
    "slm_align.named": "slm_align.config.named",
    "slm_align.tomlcompat": "slm_align.config.tomlcompat",
    "slm_align.recipe_overrides": "slm_align.config.overrides",
    # the interface's bug report (not tools/environment.py)
    "slm_align.environment": "slm_align.cli.env_report",
    # models layer
    "slm_align.modeling": "slm_align.modeling.models",
    "slm_align.generation": "slm_align.modeling.generation",
    "slm_align.accelerator": "slm_align.modeling.accelerator",
    "slm_align.perplexity": "slm_align.scoring.perplexity",
    "slm_align.reward.model": "slm_align.scoring.reward_model",
    "slm_align.reward.learned": "slm_align.scoring.learned_reward",
    "slm_align.training": "slm_align.envelope.trainer",
    # stages: one package each, none importing another
    "slm_align.reward": "slm_align.reward_model",
    "slm_align.sft": "slm_align.sft.stage",
    "slm_align.headroom": "slm_align.headroom.stage",
    "slm_align.evaluate": "slm_align.evaluate.stage",
    # what RL shared with the gate and evaluation, a layer down
    "slm_align.rl.episodes": "slm_align.rollouts.episodes",
    "slm_align.rl.rollout": "slm_align.rollouts.completions",
    "slm_align.rl.phases": "slm_align.rollouts.phases",
    "slm_align.rl.policy_backend": "slm_align.rollouts.policy_backend",
    "slm_align.rl.recovery": "slm_align.envelope.recovery",
    "slm_align.rl.watchdog": "slm_align.envelope.watchdog",
    "slm_align.rl.watchdog_text": "slm_align.envelope.watchdog_text",
    # tests mirror the package
    "tests.agent": "tests.ondevice.agent",
    "tests.tools": "tests.ondevice.tools",
    "tests.rewards": "tests.ondevice.rewards",
    "tests.devices": "tests.ondevice.devices",
    "tests.reward": "tests.reward_model",
    "tests.test_ab_test": "tests.ondevice.agent.test_ab_sequential",
    "tests.test_template_sandbox": "tests.ondevice.templates.test_sandbox",
    "tests.test_gguf_cache": "tests.ondevice.gguf.test_cache",
    "tests.test_gguf_tokenizer": "tests.ondevice.gguf.test_tokenizer",
    "tests.test_gguf_source": "tests.ondevice.gguf.test_gguf_source",
    "tests.test_accelerator": "tests.modeling.test_accelerator",
    "tests.test_launch_files": "tests.modeling.test_launch_files",
    "tests.test_default_model": "tests.modeling.test_default_model",
    "tests.test_generation": "tests.modeling.test_generation",
    "tests.test_modeling": "tests.modeling.test_models",
    "tests.test_pickle_adapters": "tests.modeling.test_pickle_adapters",
    "tests.test_perplexity": "tests.scoring.test_perplexity",
    "tests.test_environment": "tests.cli.test_env_report",
    "tests.test_recipe_overrides": "tests.config.test_overrides",
    "tests.test_tomlcompat": "tests.config.test_tomlcompat",
    "tests.test_sft": "tests.sft.test_stage",
    "tests.test_headroom_verdicts": "tests.headroom.test_verdicts",
    "tests.rl.test_episodes": "tests.rollouts.test_episodes",
    "tests.rl.test_episode_lengths": "tests.rollouts.test_episode_lengths",
    "tests.rl.test_phases": "tests.rollouts.test_phases",
    "tests.rl.test_watchdog": "tests.envelope.test_watchdog",
}
"""Old dotted module -> new dotted module (a package move carries its submodules)."""

NAME_MOVES = {
    ("slm_align.sft.stage", "recipe_from_sft"): "slm_align.config.from_sft",
    ("slm_align.sft.stage", "recorded_data_path"): "slm_align.config.from_sft",
    ("slm_align.headroom.stage", "GateRefused"): "slm_align.envelope.gate",
    ("slm_align.headroom.stage", "Figure"): "slm_align.envelope.gate",
    ("slm_align.headroom.stage", "HeadroomReport"): "slm_align.envelope.gate",
    ("slm_align.headroom.stage", "refusal"): "slm_align.envelope.gate",
    ("slm_align.headroom.stage", "sentence"): "slm_align.envelope.gate",
    ("slm_align.export.imatrix", "imatrix_array"): "slm_align.ondevice.gguf.quantizer_imatrix",
    ("slm_align.export.converters.imatrix", "imatrix_array"): "slm_align.ondevice.gguf.quantizer_imatrix",
    ("slm_align.ondevice.agent.task_eval", "run_episodes"): "slm_align.ondevice.agent.task_eval:run_task_episodes",
    ("slm_align.ondevice.agent.sampling", "SamplingParams"): "slm_align.ondevice.agent.settings",
    ("slm_align.ondevice.agent.sampling", "PENALTY_WINDOW"): "slm_align.ondevice.agent.settings",
}
"""(new module, name) -> the module the name now lives in (``module:new_name`` where it was renamed:
an import keeps its old local name through ``as``)."""

SUFFIXES = {".py", ".md", ".toml", ".txt", ".cfg", ".ini", ".yml", ".yaml", ".sh"}
SKIP_DIRS = {".git", ".venv", "venv", "node_modules", "__pycache__", ".ruff_cache", ".pytest_cache"}
PACKAGE_DATA = {'"agent/static/': '"ondevice/agent/static/', '"devices/profiles/': '"ondevice/devices/profiles/'}
"""pyproject.toml's package-data globs, relative to slm_align/."""

DOTTED = re.compile(r"(?<![\w.])(?:slm_align|tests)(?:\.[A-Za-z_]\w*)+")
SLASHED = re.compile(r"(?:(?<=\.\./)|(?<![\w./-]))(slm_align/|tests/)?((?:[A-Za-z_]\w*/)*[A-Za-z_]\w*)(\.py|/)(?![\w])")
FROM = re.compile(r"^([ \t]*)from[ \t]+((?:slm_align|tests)[\w.]*)[ \t]+import[ \t]+(\([^)]*\)|[^\n]*)", re.MULTILINE)


def exists(root: Path, module: str) -> bool:
    """Whether ``module`` is a file or package in the checkout at ``root``."""
    path = root.joinpath(*module.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def starts(dotted: str, prefix: str) -> bool:
    return dotted == prefix or dotted.startswith(prefix + ".")


def map_dotted(dotted: str, moves: dict[str, str]) -> str:
    """``dotted`` with its longest old prefix replaced, unless it already starts with a
    new module at least as long (so ``slm_align.sft.stage.x`` stays as it is)."""
    olds = [old for old in moves if starts(dotted, old)]
    if not olds:
        return map_name(dotted)
    old = max(olds, key=len)
    news = [new for new in moves.values() if starts(dotted, new) and new.count(".") >= old.count(".")]
    if news:
        return map_name(dotted)
    return map_name(moves[old] + dotted[len(old):])


def map_name(dotted: str) -> str:
    """``module.name`` where the name moved out of the module."""
    for (module, name), target in NAME_MOVES.items():
        if starts(dotted, f"{module}.{name}"):
            target, _, new_name = target.partition(":")
            return f"{target}.{new_name or name}{dotted[len(module) + 1 + len(name):]}"
    return dotted


def slash_sub(match: re.Match, moves: dict[str, str], root: Path) -> str:
    prefix, body, end = match.group(1) or "", match.group(2), match.group(3)
    if not prefix and match.string[:match.start()].endswith("/"):
        return match.group(0)  # ``../x/y.py`` is a link relative to its own page, not to slm_align/
    old = (prefix or "slm_align/").removesuffix("/") + "." + body.replace("/", ".")
    new = map_dotted(old, moves)
    if new == old:
        return match.group(0)
    path = root.joinpath(*new.split("."))
    if end == "/" and not path.is_dir():
        return match.group(0)
    if end == ".py" and not path.with_suffix(".py").is_file():
        return match.group(0)
    if not prefix and body.count("/") == 0:
        return match.group(0)  # a bare ``name.py`` in prose: too ambiguous
    text = new.replace(".", "/")
    return (text if prefix else text.removeprefix("slm_align/")) + end


def split_names(names: str) -> list[str]:
    inner = names.strip()
    if inner.startswith("("):
        inner = inner[1:-1]
    inner = re.sub(r"#[^\n]*", "", inner)
    return [part.strip() for part in inner.replace("\n", " ").split(",") if part.strip()]


def from_sub(match: re.Match, moves: dict[str, str]) -> str:
    """Split ``from M import a, b`` where a name moved (out of M, or a submodule of M that moved
    elsewhere); leave the statement as written when nothing moved."""
    indent, module, names = match.group(1), match.group(2), match.group(3)
    comment = ""
    if not names.strip().startswith("(") and "#" in names:
        names, comment = names.split("#", 1)
        comment = "  #" + comment
    parts = split_names(names)
    if not parts or "*" in parts:
        return match.group(0)
    stay, moved = [], {}
    for part in parts:
        name, _, alias = part.partition(" as ")
        name, alias = name.strip(), alias.strip()
        full = map_dotted(f"{module}.{name}", moves)
        target, _, new_name = full.rpartition(".")
        if target == module and new_name == name:
            stay.append(part)
            continue
        local = alias or name
        moved.setdefault(target, []).append(new_name if new_name == local else f"{new_name} as {local}")
    if not moved:
        return match.group(0)
    lines = []
    if stay:
        lines.append(f"{indent}from {module} import {', '.join(stay)}")
    for target, new_parts in moved.items():
        lines.append(f"{indent}from {target} import {', '.join(new_parts)}")
    lines[0] += comment
    return "\n".join(lines)


def rewrite(text: str, moves: dict[str, str], root: Path, pyproject: bool = False) -> str:
    text = DOTTED.sub(lambda match: map_dotted(match.group(0), moves), text)
    text = FROM.sub(lambda match: from_sub(match, moves), text)
    text = SLASHED.sub(lambda match: slash_sub(match, moves, root), text)
    if pyproject:
        for old, new in PACKAGE_DATA.items():
            if (root / "slm_align" / new.strip('"')).is_dir():
                text = text.replace(old, new)
    return text


def files(root: Path):
    me = Path(__file__).resolve()
    for path in sorted(root.rglob("*")):
        if path.suffix not in SUFFIXES or not path.is_file() or path.resolve() == me:
            continue
        if SKIP_DIRS & set(path.relative_to(root).parts):
            continue
        yield path


SELF_TEST = {
    "from slm_align.agent.task_eval import run_episodes, compare\n":
        "from slm_align.ondevice.agent.task_eval import compare\n"
        "from slm_align.ondevice.agent.task_eval import run_task_episodes as run_episodes\n",
    "from slm_align.sft import recipe_from_sft, run_sft\n":
        "from slm_align.sft.stage import run_sft\nfrom slm_align.config.from_sft import recipe_from_sft\n",
    "from slm_align import chat_templates, errors\n":
        "from slm_align import errors\nfrom slm_align.ondevice.templates import chat as chat_templates\n",
    'setattr("slm_align.modeling.load_model", x)\n': 'setattr("slm_align.modeling.models.load_model", x)\n',
    'setattr("slm_align.headroom.refusal", x)\n': 'setattr("slm_align.envelope.gate.refusal", x)\n',
    "[x](../slm_align/rl/episodes.py), slm_align/sft.py, rl/watchdog.py, tests/agent/test_store.py\n":
        "[x](../slm_align/rollouts/episodes.py), slm_align/sft/stage.py, envelope/watchdog.py, "
        "tests/ondevice/agent/test_store.py\n",
    "import slm_align.rl.recovery as recovery\nfrom tests.rl.test_episodes import y\n":
        "import slm_align.envelope.recovery as recovery\nfrom tests.rollouts.test_episodes import y\n",
}
"""Text before -> after, checked by ``--self-test`` over this checkout (after the moves), each twice."""


def self_test(root: Path) -> int:
    moves = {old: new for old, new in MOVES.items() if exists(root, new)}
    failed = 0
    for before, after in SELF_TEST.items():
        once = rewrite(before, moves, root)
        twice = rewrite(once, moves, root)
        if once != after or twice != once:
            failed += 1
            print(f"FAIL {before!r}\n  got {once!r}\n  then {twice!r}\n  want {after!r}")
    print(f"{len(SELF_TEST) - failed} of {len(SELF_TEST)} rewrites as expected")
    return 1 if failed else 0


def main(argv: list[str]) -> int:
    if argv[:1] == ["--self-test"]:
        return self_test(Path(__file__).resolve().parents[1])
    if not argv or argv[0].startswith("-"):
        print(__doc__)
        return 2
    root = Path(argv[0]).resolve()
    dry = "--dry-run" in argv
    moves = {old: new for old, new in MOVES.items() if exists(root, new)}
    changed = 0
    for path in files(root):
        text = path.read_text(encoding="utf-8", errors="surrogateescape")
        new = rewrite(text, moves, root, pyproject=path.name == "pyproject.toml")
        if new != text:
            changed += 1
            print(path.relative_to(root))
            if not dry:
                path.write_text(new, encoding="utf-8", errors="surrogateescape")
    print(f"{changed} files {'would change' if dry else 'changed'}; {len(moves)} of {len(MOVES)} moves apply")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
