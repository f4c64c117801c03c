"""The package's public API: what the README's Python examples import is there, and
importing it stays light."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import slm_align

README = Path(__file__).resolve().parents[2] / "README.md"


def test_all_lists_exactly_the_exported_names():
    assert sorted(slm_align.__all__) == sorted([*slm_align._EXPORTS, "__version__"])


def test_every_public_name_resolves_to_its_definition():
    import inspect

    from slm_align.evaluate.stage import evaluate
    from slm_align.export.publishing.stage import run_export
    from slm_align.ondevice.agent.runtime import Agent

    assert slm_align.Agent is Agent
    assert slm_align.run_evaluation is evaluate
    assert slm_align.run_export is run_export
    for name in slm_align.__all__:
        value = getattr(slm_align, name)
        assert inspect.isclass(value) or callable(value) or name == "__version__", name


def test_unknown_names_raise_attribute_error():
    try:
        slm_align.run_everything  # noqa: B018
    except AttributeError as exc:
        assert "run_everything" in str(exc)
    else:
        raise AssertionError("an unknown name resolved")


def test_the_readmes_python_examples_import_the_public_api():
    imported = re.findall(r"^from slm_align import (.+)$", README.read_text(encoding="utf-8"), flags=re.MULTILINE)
    names = {name.strip() for line in imported for name in line.split("#")[0].split(",")}
    assert {"Agent", "load_recipe", "run_sft", "run_export"} <= names
    assert names <= set(slm_align.__all__)


def test_importing_the_package_and_the_agent_does_not_import_torch():
    code = ("import sys, slm_align; from slm_align import Agent, default_tools; "
            "print('torch' in sys.modules, 'transformers' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=600)
    assert done.stdout.split() == ["False", "False"]
