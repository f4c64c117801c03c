"""Python 3.10's TOML reader: recipes and device profiles load through tomli,
declared for 3.10 only."""

import subprocess
import sys
from pathlib import Path

from slm_align.config.tomlcompat import tomllib

ROOT = Path(__file__).resolve().parents[2]


def test_python_310_reads_recipes_with_tomli(tmp_path):
    """Without the standard library's tomllib (Python 3.10), recipes and device
    profiles load through tomli."""
    recipe = tmp_path / "recipe.toml"
    recipe.write_text("seed = 7\n[sft]\nlearning_rate = 0.001\n")
    broken = tmp_path / "broken.toml"
    broken.write_text("[sft\n")
    script = (
        "import sys\nsys.modules['tomllib'] = None  # as on Python 3.10: import tomllib fails\n"
        "from slm_align.config import load_recipe\n"
        "from slm_align.ondevice.devices import load_profile\n"
        "from slm_align.errors import UserError\n"
        "from slm_align.config.tomlcompat import tomllib\n"
        f"recipe = load_recipe({str(recipe)!r})\n"
        "assert tomllib.__name__ == 'tomli', tomllib\n"
        "assert recipe.seed == 7 and recipe.sft.learning_rate == 0.001\n"
        "assert load_profile('rpi5').threads >= 1\n"
        f"try:\n    load_recipe({str(broken)!r})\n"
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
