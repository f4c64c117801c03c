"""Data never runs code by itself: a task row's ``environment`` column names a class, and importing its module runs
that module's code, so rows may name classes only from modules the user allowed (``--environment-module``, the
recipe's ``rl.environment_modules``); any other is refused in one line, exit 2, before anything is imported
(issue 45, item 7)."""

from __future__ import annotations

import itertools
import json
import sys

import pytest
from pydantic import ValidationError

from slm_align.config import RLSettings
from slm_align.data.tasks import TaskSet
from slm_align.errors import UserError
from slm_align.rollouts.episodes import agent_tasks
from tests.helpers import run_cli
from tests.rollouts.test_episodes import QUICK, SMALL, task_file

MARKER = '''
from pathlib import Path

Path(__file__).with_name("imported.txt").write_text("the module's code ran")


class Env:
    def reset(self, start: int = 0, **_):
        self.total = int(start)

    def add(self, amount: int) -> str:
        """Add to the total.

        Args:
            amount: How much to add.
        """
        self.total += amount
        return str(self.total)

    def get_reward(self) -> float:
        return float(self.total)
'''
NAMES = itertools.count()
ZEN = "Beautiful is better than ugly"


@pytest.fixture
def marker(tmp_path, monkeypatch):
    """A module on a temporary ``sys.path`` whose import writes ``imported.txt`` next to it: (its name, that
    file). Each test gets a new name, so no import is cached from another."""
    folder = tmp_path / "modules"
    folder.mkdir()
    name = f"sec_marker_{next(NAMES)}"
    (folder / f"{name}.py").write_text(MARKER, encoding="utf-8")
    monkeypatch.syspath_prepend(str(folder))
    yield name, folder / "imported.txt"
    sys.modules.pop(name, None)


def train(capsys, tmp_path, tiny_models, tasks, *extra):
    config = tmp_path / "quick.toml"
    config.write_text(QUICK, encoding="utf-8")
    return run_cli(capsys, "train", "--no-sft", "--model", tiny_models["llama"], "--tasks", tasks, "--reward",
                   "environment_reward", "--algo", "ppo", "--out", tmp_path / "run", "--config", config, *SMALL,
                   *extra)


def refused_in_one_line(code, out, err, module):
    assert (code, out) == (2, ""), err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert f"--environment-module {module}" in err and "names the environment" in err


@pytest.mark.parametrize("allowed", [[], ["sec_marker"], ["sec_marker_0x"]])
def test_train_refuses_a_rows_environment_from_a_module_not_allowed_before_importing_it(
        tmp_path, capsys, tiny_models, marker, allowed):
    name, imported = marker
    tasks = task_file(tmp_path / "tasks.jsonl", environment=f"{name}:Env", start=3)
    flags = [arg for module in allowed for arg in ("--environment-module", module)]
    code, out, err = train(capsys, tmp_path, tiny_models, tasks, *flags)
    refused_in_one_line(code, out, err, name)
    assert not imported.exists() and name not in sys.modules  # its code never ran
    assert not (tmp_path / "run").exists()  # refused before any stage wrote a thing


def test_a_row_naming_any_installed_module_is_refused_too(tmp_path, capsys, tiny_models):
    tasks = task_file(tmp_path / "tasks.jsonl", environment="this:X")
    imported_before = "this" in sys.modules
    code, out, err = train(capsys, tmp_path, tiny_models, tasks)
    refused_in_one_line(code, out, err, "this")
    assert ZEN not in out + err and ("this" in sys.modules) == imported_before


def test_check_headroom_refuses_it_as_well(tmp_path, capsys, tiny_models, marker):
    name, imported = marker
    tasks = task_file(tmp_path / "tasks.jsonl", environment=f"{name}:Env")
    code, out, err = run_cli(capsys, "check-headroom", "--model", tiny_models["llama"], "--tasks", tasks,
                             "--reward", "environment_reward", "--json")
    refused_in_one_line(code, out, err, name)
    assert not imported.exists()


def test_an_allowed_module_runs_as_the_rows_environment(tmp_path, capsys, tiny_models, marker):
    name, imported = marker
    tasks = task_file(tmp_path / "tasks.jsonl", environment=f"{name}:Env", start=3)
    code, out, err = train(capsys, tmp_path, tiny_models, tasks, "--environment-module", name)
    assert code == 0, err
    assert imported.exists()
    manifest = json.loads((tmp_path / "run" / "rl" / "manifest.json").read_text())
    assert manifest["inputs"]["rl"]["environment_modules"] == [name]
    assert manifest["metrics"]["heldout_reward_sft"] == 3.0  # the rows' environment scored: each reset to 3


def test_the_recipe_setting_and_environment_allow_it_and_a_package_allows_its_submodules(marker):
    from slm_align.ondevice.tools.environment import module_allowed

    name, imported = marker
    tasks = TaskSet(["Count."], [{"environment": f"{name}:Env", "start": 2}])
    with pytest.raises(UserError, match=f"--environment-module {name}"):
        agent_tasks(RLSettings(episodes="on"), tasks)
    assert not imported.exists()
    episodes = agent_tasks(RLSettings(episodes="on", environment_modules=[name]), tasks)
    assert imported.exists() and episodes.open("Count.").environment.total == 2
    assert agent_tasks(RLSettings(episodes="on", environment=f"{name}:Env"), tasks) is not None  # named: allowed
    assert module_allowed("my_pkg.envs", ["my_pkg"]) and module_allowed("my_pkg", ["my_pkg"])
    assert not module_allowed("my_pkg_evil", ["my_pkg"]) and not module_allowed("my", ["my_pkg"])


def test_a_row_environment_that_is_not_text_or_a_bad_module_name_is_refused():
    with pytest.raises(UserError, match="'environment' must be text"):
        agent_tasks(RLSettings(episodes="on"), TaskSet(["Count."], [{"environment": {"module": "os"}}]))
    with pytest.raises(UserError, match="name it as module:Class"):
        agent_tasks(RLSettings(episodes="on", environment_modules=["Counter"]), TaskSet(["Count."],
                                                                                      [{"environment": "Counter"}]))
    with pytest.raises(ValidationError, match="not a module name"):
        RLSettings(environment_modules=["os; import this"])
