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


def test_unittest_output_shows_the_failing_test_method_with_its_inputs(tmp_path):
    """The traceback's assertion line hides the inputs the test built above it; the cut output
    shows the whole (short) test method, once per failure kept."""
    (tmp_path / "etl.py").write_text("def transform(data):\n    return {k.lower(): v for k, v in data.items()}\n")
    (tmp_path / "etl_test.py").write_text(
        "import unittest\nfrom etl import transform\n\n\nclass EtlTest(unittest.TestCase):\n"
        "    def test_one(self):\n        legacy_data = {1: ['A']}\n\n        data = {'a': 1}\n"
        "        self.assertEqual(transform(legacy_data), data)\n\n"
        "    def test_long(self):\n" + "        x = 1\n" * 20 + "        self.assertEqual(transform({2: ['B']}), {'b': 2})\n")
    raw = run(tmp_path, "unittest", "etl_test")
    out = failures_only(raw)
    assert "def test_one(self):\n    legacy_data = {1: ['A']}\n    data = {'a': 1}\n" in out, out
    assert out.count("The test:") == 1  # the 22-line method is not shown whole
    assert "AttributeError" in out and out.rstrip().endswith("FAILED (errors=2)")
