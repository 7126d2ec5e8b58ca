"""Every test of the suite has a time limit (pytest-timeout, set in pyproject.toml), so that
a hang fails its test in minutes, with the hung stack, instead of running into CI's limit."""

from __future__ import annotations

import pytest


def test_the_suite_gives_every_test_a_time_limit(pytestconfig: pytest.Config) -> None:
    assert pytestconfig.pluginmanager.hasplugin("timeout"), "pytest-timeout is not installed: pip install -e '.[test]'"
    limit = float(pytestconfig.getini("timeout"))
    assert 0 < limit <= 15 * 60, limit


def test_a_test_that_hangs_fails_at_its_limit_naming_the_hang(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_hangs="""
        import threading

        def test_waits_forever():
            threading.Event().wait()
        """
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--timeout=2")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*FAILED test_hangs.py::test_waits_forever - Failed: Timeout (>2.0s)*"])
