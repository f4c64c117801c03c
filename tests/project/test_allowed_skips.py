"""Under CI=true a skip is a failure unless its reason is in tests/allowed_skips.py: a package the dev extra
installs that does not import must fail the run, not thin it out."""

import pytest

pytest_plugins = ["pytester"]

INNER_TESTS = """
import pytest

def test_missing_package():
    pytest.importorskip("no_such_package_of_slm_align")

def test_gpu():
    pytest.skip("needs a CUDA GPU")

def test_passes():
    pass
"""
SKIPPED_MODULE = """
import pytest

pytest.importorskip("no_such_package_of_slm_align")

def test_never_collected():
    pass
"""


@pytest.fixture
def inner(pytester):
    pytester.makeconftest("from tests.conftest import pytest_make_collect_report, pytest_runtest_makereport\n")
    pytester.makepyfile(test_inner=INNER_TESTS, test_skipped_module=SKIPPED_MODULE)
    return pytester


def test_under_ci_a_skip_fails_unless_its_reason_is_allowed(inner, monkeypatch):
    monkeypatch.setenv("CI", "true")
    result = inner.runpytest("--continue-on-collection-errors")
    result.assert_outcomes(passed=1, skipped=1, failed=1, errors=1)  # the GPU skip stays a skip
    result.stdout.fnmatch_lines(["FAILED test_inner.py::test_missing_package - skipped under CI=true: could not "
                                 "import 'no_such_package_of_slm_align'*",
                                 "ERROR test_skipped_module.py - skipped under CI=true: could not import*"])


def test_outside_ci_the_same_skips_stay_skips(inner, monkeypatch):
    monkeypatch.setenv("CI", "false")
    inner.runpytest().assert_outcomes(passed=1, skipped=3)
