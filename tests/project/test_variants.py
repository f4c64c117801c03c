"""Variants are objects: no module of slm_align branches on an algorithm's name. Each algorithm's
class says what it needs (rl/learner.py, preference/learner.py), looked up by name in its registry."""

import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "slm_align"

REGISTRIES = {"rl/algorithms.py", "preference/algorithms.py"}
"""The modules that map an ``--algo`` name to its class: the only ones that may look at the name."""

NAME_CHAIN = re.compile(r"algo\s*(==|!=)|algo\s+in\s*[(\[{]|\.algo\s+(not\s+)?in\b")
"""``algo ==``, ``algo !=``, ``algo in (``/``[``/``{`` and ``.algo in`` (or ``not in``)."""


def name_chains(root: Path) -> list[str]:
    """Every line of ``root``'s modules (registries apart) that branches on an algorithm's name."""
    found = []
    for path in sorted(root.rglob("*.py")):
        if path.relative_to(root).as_posix() in REGISTRIES:
            continue
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if NAME_CHAIN.search(line):
                found.append(f"{path.relative_to(root.parent)}:{number}: {line.strip()}")
    return found


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
