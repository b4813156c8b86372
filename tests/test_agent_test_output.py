"""Test-runner output cut to the first failures: real unittest and pytest runs on a small suite."""

import subprocess
import sys

from agents.test_output import failures_only

SUITE = '''\
import unittest

def double(x):
    return x + 1

class DoubleTest(unittest.TestCase):
{tests}
'''


def failing_suite(tmp_path, n=6):
    tests = "\n".join(f"    def test_{i}(self):\n        self.assertEqual(\n            double({i}),\n            {2 * i},\n        )\n"
                      for i in range(2, 2 + n))
    (tmp_path / "double_test.py").write_text(SUITE.format(tests=tests))


def run(tmp_path, *args):
    return subprocess.run([sys.executable, "-m", *args], cwd=tmp_path, capture_output=True, text=True).stderr


def test_unittest_output_keeps_three_failures_whole_statements_and_the_summary(tmp_path):
    failing_suite(tmp_path)
    raw = run(tmp_path, "unittest", "double_test")
    out = failures_only(raw)
    assert raw.count("FAIL: ") == 6 and out.count("FAIL: ") == 3
    assert "[... 3 more failures not shown ...]" in out
    # the assertion spans four lines in the file; the traceback shows one, the cut output all of it
    assert "self.assertEqual( double(2), 4, )" in out and "AssertionError: 3 != 4" in out
    assert out.rstrip().endswith("FAILED (failures=6)") and "Ran 6 tests" in out
    assert "Traceback (most recent call last)" not in out and len(out) < len(raw) / 2


def test_pytest_output_keeps_the_first_failures_and_the_summary(tmp_path):
    import pytest  # noqa: F401  (the suite runs under the test extra's pytest)
    failing_suite(tmp_path, 5)
    raw = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "double_test.py"],
                         cwd=tmp_path, capture_output=True, text=True).stdout
    out = failures_only(raw)
    assert out.count("DoubleTest.test_") == 3 and "[... 2 more failures not shown ...]" in out
    assert out.splitlines()[-1].startswith("5 failed") and "short test summary" not in out
    assert "AssertionError: 3 != 4" in out


def test_other_output_is_unchanged():
    text = "SyntaxError: invalid syntax\n  File solver.py, line 3"
    assert failures_only(text) == text
