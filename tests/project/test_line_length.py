"""The house's line-length rule: lines over 100 characters stay under 5% of slm_align/ (ruff's hard
limit is 120; the 100 is the reading width the code is written to)."""

from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "slm_align"
LONG_LINE = 100
MAX_LONG_SHARE = 0.05


def long_line_share(root: Path) -> tuple[int, int]:
    """(lines over LONG_LINE characters, all lines) of the Python files below ``root``."""
    long_lines = 0
    total = 0
    for path in sorted(root.rglob("*.py")):
        lines = path.read_text(encoding="utf-8").splitlines()
        total += len(lines)
        long_lines += sum(1 for line in lines if len(line) > LONG_LINE)
    return long_lines, total


def test_lines_over_100_characters_stay_under_5_percent():
    long_lines, total = long_line_share(PACKAGE)
    assert long_lines < MAX_LONG_SHARE * total, (
        f"{long_lines} of {total} lines ({long_lines / total:.1%}) are over {LONG_LINE} characters; "
        f"wrap some (`python benchmarks/house.py` lists the share)")


def test_the_share_counts_what_is_over_the_width(tmp_path):
    (tmp_path / "a.py").write_text("x = 1\n" + "y = '" + "z" * 95 + "'\n" + "w = '" + "z" * 94 + "'\n")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.py").write_text("#" * 101 + "\n")
    assert long_line_share(tmp_path) == (2, 4)
