"""The basics a user reaches for first: --version, `env` for bug reports, Python 3.10's TOML reader, hub datasets."""

import json
import subprocess
import sys
from pathlib import Path

import slm_align
from slm_align.tomlcompat import tomllib
from tests.helpers import run_cli

ROOT = Path(__file__).resolve().parent.parent


def test_version_prints_the_package_version(capsys):
    code, out, _ = run_cli(capsys, "--version")
    assert code == 0 and out.strip() == f"slm-align {slm_align.__version__}"


def test_env_json_reports_versions_threads_cpu_and_runtimes(capsys):
    import llama_cpp
    import torch

    code, out, err = run_cli(capsys, "env", "--json")
    report = json.loads(out)
    assert code == 0, err
    assert report["slm_align"] == slm_align.__version__ and report["python"] == sys.version.split()[0]
    packages = report["packages"]
    assert packages["torch"] == torch.__version__ and packages["typer"] and packages["pydantic"]
    assert packages["llama-cpp-python"] == llama_cpp.__version__
    assert report["torch"]["threads"] == torch.get_num_threads()
    assert report["torch"]["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert "CPU" in report["llama_cpp"]["system_info"]  # llama.cpp's own build flags (AVX2 = 1 | ...)
    assert report["cpu"]["logical_cpus"] >= 1 and isinstance(report["cpu"]["features"], list)
    assert isinstance(report["accelerators"], list)
    assert ("cuda:0" in " ".join(report["accelerators"])) == torch.cuda.is_available()


def test_env_for_people_names_each_part(capsys):
    code, out, _ = run_cli(capsys, "env")
    assert code == 0
    for part in ("slm-align", "CPU:", "torch:", "llama.cpp:", "accelerators:", "packages:"):
        assert part in out


def nothing_installed(module: str) -> bool:
    """As on a board without torch, llama.cpp or onnxruntime."""
    return False


def test_env_reports_a_missing_library_as_not_installed(monkeypatch):
    from slm_align import environment

    monkeypatch.setattr(environment, "ALSO_REPORTED", ("no-such-distribution-xyz",))
    monkeypatch.setattr(environment, "_installed", nothing_installed)
    report = environment.collect_environment()
    assert report["packages"]["no-such-distribution-xyz"] is None
    assert report["torch"] is None and report["llama_cpp"] is None and report["accelerators"] == []


def test_python_310_reads_recipes_with_tomli(tmp_path):
    """Without the standard library's tomllib (Python 3.10), recipes and device profiles load through tomli."""
    recipe = tmp_path / "recipe.toml"
    recipe.write_text("seed = 7\n[sft]\nlearning_rate = 0.001\n")
    broken = tmp_path / "broken.toml"
    broken.write_text("[sft\n")
    script = (
        "import sys\n"
        "sys.modules['tomllib'] = None  # as on Python 3.10: import tomllib fails\n"
        "from slm_align.config import load_recipe\n"
        "from slm_align.devices import load_profile\n"
        "from slm_align.errors import UserError\n"
        "from slm_align.tomlcompat import tomllib\n"
        f"recipe = load_recipe({str(recipe)!r})\n"
        "assert tomllib.__name__ == 'tomli', tomllib\n"
        "assert recipe.seed == 7 and recipe.sft.learning_rate == 0.001\n"
        "assert load_profile('rpi5').threads >= 1\n"
        "try:\n"
        f"    load_recipe({str(broken)!r})\n"
        "except UserError as exc:\n"
        "    print('refused:', exc)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "refused:" in done.stdout and "not valid TOML" in done.stdout


def test_tomli_is_declared_for_python_310_only():
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert any(dep.replace(" ", "").startswith("tomli") and "python_version<'3.11'" in dep.replace(" ", "")
               for dep in dependencies)


def test_an_unreachable_hub_dataset_is_one_line_exit_2(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = tmp_path / "run"
    code, _, err = run_cli(capsys, "sft", "--data", "nobody-here/no-such-dataset", "--out", out, "--max-steps", "1")
    assert code == 2 and err.count("\n") == 1
    assert "nobody-here/no-such-dataset" in err and "datasets cache or the hub" in err
    assert not out.exists()


def test_a_hub_dataset_in_the_cache_is_read(monkeypatch):
    """A hub id reaches datasets.load_dataset; its train split's rows become the corpus."""
    import datasets

    from slm_align.data import hub
    from slm_align.data.readers import fingerprint, read_examples

    table = datasets.DatasetDict({"test": datasets.Dataset.from_dict({"text": ["held out"]}),
                                  "train": datasets.Dataset.from_dict({"text": ["one story.", "two stories."]})})
    asked = []

    def cached(name):
        asked.append(name)
        return table

    hub.load_hub_dataset.cache_clear()
    monkeypatch.setattr(datasets, "load_dataset", cached)
    try:
        examples = read_examples(Path("someone/stories"))
        digest = fingerprint(Path("someone/stories"))
    finally:
        hub.load_hub_dataset.cache_clear()
    assert [example.text for example in examples] == ["one story.", "two stories."]
    assert digest == f"hub:someone/stories:{table['train']._fingerprint}" and asked == ["someone/stories"]


def test_a_missing_local_file_is_not_taken_for_a_hub_id(tmp_path):
    from slm_align.data.hub import is_hub_dataset
    from slm_align.data.readers import SUFFIXES

    assert not is_hub_dataset(tmp_path / "nope.jsonl", SUFFIXES)
    assert not is_hub_dataset(tmp_path / "stories", SUFFIXES)  # an absolute path
    assert is_hub_dataset(Path("roneneldan/TinyStories"), SUFFIXES)
