"""Test-runner output cut down to what a small model can act on: the first few failures and the summary.

Exercism-style suites fail many tests at once; unittest prints every failure in full, so one
repair round's output runs to 3-6k characters. On two CPU cores the 1.5B model prefills about
40 tokens a second, so every failure beyond the first few costs seconds and buys little: the
model fixes one or two causes per round. unittest (``=====`` separated blocks) and pytest
(``____ name ____`` sections) are recognised; any other output is returned unchanged.
"""

from __future__ import annotations

import re
from pathlib import Path

MAX_FAILURES = 3  # failure blocks kept, in the order the runner printed them
BLOCK_LINES = 12  # lines kept per block: its header, then the end of the traceback (the assertion)

_UNITTEST_SEP = re.compile(r"^={20,}$", re.M)
_UNITTEST_SUMMARY = re.compile(r"^(Ran \d+ tests? in .*|FAILED \(.*\)|OK.*)$", re.M)
_PYTEST_SECTION = re.compile(r"^_{3,} (.+?) _{3,}$", re.M)
_PYTEST_SUMMARY = re.compile(r"^(=+ )?.*\b\d+ (failed|passed|errors?)\b.* in [\d.]+s( \(.*\))?( =+)?$", re.M)


STATEMENT_LINES = 6  # a multi-line assertion in a traceback is shown whole, up to this many lines
TEST_SOURCE_LINES = 14  # a failing test method up to this long is shown whole (its inputs and expected value)
_TRACE_LINE = re.compile(r'^(\s*)File "([^"]+)", line (\d+), in (\w+)\n(\s*)(.*)$', re.M)


def failures_only(text: str, max_failures: int = MAX_FAILURES, block_lines: int = BLOCK_LINES) -> str:
    """``text`` with only its first ``max_failures`` failure blocks (each cut to ``block_lines``)
    and the runner's summary; unchanged when it is not unittest or pytest output."""
    if _UNITTEST_SEP.search(text):
        return _unittest(_whole_statements(text), max_failures, block_lines)
    if _PYTEST_SECTION.search(text) and _PYTEST_SUMMARY.search(text):
        return _pytest(text, max_failures, block_lines)
    return text


def _whole_statements(text: str) -> str:
    """Tracebacks show one line of a statement: ``self.assertEqual(`` hides the input that failed.
    Where the traceback's file can be read, its line is replaced by the whole statement."""
    def whole(m: re.Match) -> str:
        path, line_no, code = Path(m.group(2)), int(m.group(3)), m.group(6)
        if not code.rstrip().endswith(("(", ",", "[", "{")):
            return m.group(0)
        try:
            lines = path.read_text(encoding="utf-8", errors="replace").split("\n")[line_no - 1: line_no - 1 + STATEMENT_LINES]
        except OSError:
            return m.group(0)
        taken, depth = [], 0
        for x in lines:
            taken.append(x.strip())
            depth += sum(x.count(c) for c in "([{") - sum(x.count(c) for c in ")]}")
            if depth <= 0:
                break
        return f"{m.group(1)}File \"{m.group(2)}\", line {line_no}, in {m.group(4)}\n{m.group(5)}{' '.join(taken)}"
    return _TRACE_LINE.sub(whole, text)


def _cut_block(block: str, block_lines: int) -> str:
    lines = [x for x in block.strip("\n").split("\n")
             if not re.fullmatch(r"-{20,}", x.strip()) and x != "Traceback (most recent call last):"]
    if len(lines) <= block_lines:
        return "\n".join(lines)
    return "\n".join([lines[0], "  ...", *lines[-(block_lines - 1):]])


def _unittest(text: str, max_failures: int, block_lines: int) -> str:
    parts = _UNITTEST_SEP.split(text)
    blocks = [p for p in parts[1:] if p.strip().startswith(("FAIL:", "ERROR:"))]
    tail = parts[-1]
    summary = "\n".join(m.group(0) for m in _UNITTEST_SUMMARY.finditer(tail))
    if blocks:  # the last block also holds the summary: keep only the failure part of it
        blocks[-1] = re.split(r"^-{20,}\s*\nRan \d+", blocks[-1], flags=re.M)[0]
    kept = [_with_test_source(_cut_block(b, block_lines), b) for b in blocks[:max_failures]]
    out = "\n\n".join(kept)
    if len(blocks) > max_failures:
        out += f"\n\n[... {len(blocks) - max_failures} more failures not shown ...]"
    return f"{out}\n\n{summary}".strip() if out else text


def _with_test_source(cut: str, block: str) -> str:
    """``cut`` with the failing test method's source after its header line, where the traceback
    names a readable test file and the method is short. The assertion alone, e.g.
    ``self.assertEqual(transform(legacy_data), data)``, hides the input the test built on the
    lines above it; the 1.5B then rewrote the same wrong solution (etl: ints read as letters)."""
    source = _test_source(block)
    if source is None:
        return cut
    head, _, rest = cut.partition("\n")
    return f"{head}\nThe test:\n{source}\n{rest}" if rest else f"{head}\nThe test:\n{source}"


def _test_source(block: str) -> str | None:
    frame = next((m for m in _TRACE_LINE.finditer(block) if m.group(4).startswith("test")), None)
    if frame is None:
        return None
    try:
        lines = Path(frame.group(2)).read_text(encoding="utf-8", errors="replace").split("\n")
    except OSError:
        return None
    at = int(frame.group(3)) - 1
    start = next((i for i in range(min(at, len(lines) - 1), -1, -1)
                  if re.match(rf"\s*def {re.escape(frame.group(4))}\(", lines[i])), None)
    if start is None:
        return None
    indent = len(lines[start]) - len(lines[start].lstrip())
    end = start + 1
    while end < len(lines) and (not lines[end].strip() or len(lines[end]) - len(lines[end].lstrip()) > indent):
        end += 1
    body = [x for x in lines[start:end] if x.strip()]
    if len(body) > TEST_SOURCE_LINES:
        return None
    return "\n".join(x[indent:] for x in body)


def _pytest(text: str, max_failures: int, block_lines: int) -> str:
    heads = list(_PYTEST_SECTION.finditer(text))
    summary_match = list(_PYTEST_SUMMARY.finditer(text))[-1]
    blocks = []
    for i, h in enumerate(heads):
        end = heads[i + 1].start() if i + 1 < len(heads) else summary_match.start()
        blocks.append(text[h.start():end])
    # pytest's own "short test summary info" section sits between the last block and the summary
    blocks = [re.split(r"^=+ short test summary info =+$", b, flags=re.M)[0] for b in blocks]
    kept = [_cut_block(b, block_lines) for b in blocks[:max_failures]]
    out = "\n\n".join(kept)
    if len(blocks) > max_failures:
        out += f"\n\n[... {len(blocks) - max_failures} more failures not shown ...]"
    return f"{out}\n\n{summary_match.group(0)}"


_RAN = re.compile(r"^Ran (\d+) tests? in ", re.M)
_UNITTEST_FAILED = re.compile(r"^FAILED \((.*)\)$", re.M)
_PYTEST_COUNT = re.compile(r"\b(\d+) (passed|failed|errors?)\b")


def tests_passed(text: str) -> int | None:
    """How many tests passed, read from unittest's or pytest's summary; None when the output has
    none (a crash before the runner started counts as None, not 0). Ranks failing drafts."""
    ran = _RAN.findall(text)
    if ran:
        total = int(ran[-1])
        failed = _UNITTEST_FAILED.findall(text)
        bad = sum(int(n) for n in re.findall(r"(?:failures|errors)=(\d+)", failed[-1])) if failed else 0
        return max(0, total - bad)
    summary = _PYTEST_SUMMARY.findall(text)
    if summary:
        last = [m for m in _PYTEST_SUMMARY.finditer(text)][-1].group(0)
        return sum(int(n) for n, word in _PYTEST_COUNT.findall(last) if word == "passed")
    return None
