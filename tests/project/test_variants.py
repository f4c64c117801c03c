"""Variants are objects: no module of slm_align branches on an algorithm's name. Each algorithm's
class says what it needs (rl/learner.py, preference/learner.py), looked up by name in its registry.
No module of the export branches on a record's kind: an export's origin is one class per kind
(export/publishing/sources.py), built once from the source string or the manifest's record."""

import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "slm_align"

REGISTRIES = {"rl/algorithms.py", "preference/algorithms.py"}
"""The modules that map an ``--algo`` name to its class: the only ones that may look at the name."""

NAME_CHAIN = re.compile(r"algo\s*(==|!=)|algo\s+in\s*[(\[{]|\.algo\s+(not\s+)?in\b")
"""``algo ==``, ``algo !=``, ``algo in (``/``[``/``{`` and ``.algo in`` (or ``not in``)."""


KIND_CHAIN = re.compile(r"""\[\s*["']kind["']\s*\]\s*(==|!=|(not\s+)?in\b)""")
"""``["kind"] ==``, ``["kind"] !=`` and ``["kind"] in`` (or ``not in``), either quote."""


def chains(root: Path, pattern: re.Pattern, skip: frozenset = frozenset()) -> list[str]:
    """Every line of ``root``'s modules (``skip`` apart, relative paths) that ``pattern`` finds."""
    found = []
    for path in sorted(root.rglob("*.py")):
        if path.relative_to(root).as_posix() in skip:
            continue
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if pattern.search(line):
                found.append(f"{path.relative_to(root.parent)}:{number}: {line.strip()}")
    return found


def name_chains(root: Path) -> list[str]:
    """Every line of ``root``'s modules (registries apart) that branches on an algorithm's name."""
    return chains(root, NAME_CHAIN, frozenset(REGISTRIES))


def test_no_module_branches_on_an_algorithm_name_outside_the_registries():
    assert name_chains(PACKAGE) == []


def test_the_rule_sees_each_form_of_a_name_chain(tmp_path):
    package = tmp_path / "slm_align"
    (package / "rl").mkdir(parents=True)
    lines = ['if settings.algo == "grpo":', "if algo != 'auto':", 'if algo in ("dpo", "kto"):',
             "if recipe.rl.algo in PREFERENCE:", "if recipe.rl.algo not in GATE:", "x = 1"]
    (package / "schedule.py").write_text("\n".join(lines), encoding="utf-8")
    (package / "rl" / "algorithms.py").write_text('if algo == "ppo":', encoding="utf-8")
    assert [line.split(": ", 1)[1] for line in name_chains(package)] == lines[:-1]


def test_no_export_module_branches_on_a_records_kind():
    assert chains(PACKAGE / "export", KIND_CHAIN) == []


def test_the_rule_sees_each_form_of_a_kind_chain(tmp_path):
    export = tmp_path / "export"
    export.mkdir()
    lines = ['if origin["kind"] == "run":', "if origin['kind'] != 'run':",
             'if origin["kind"] in ("dir", "bundled"):', 'if record[ "kind" ] not in KINDS:',
             'kind = origin["kind"]', "x = 1"]
    (export / "sources.py").write_text("\n".join(lines), encoding="utf-8")
    assert [line.split(": ", 1)[1] for line in chains(export, KIND_CHAIN)] == lines[:4]
