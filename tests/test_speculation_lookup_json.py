"""Prompt lookup for agent tool calls: the model copies file text as a JSON string (escaped
newlines and quotes), which only the second index, over the context's JSON-escaped tokens,
can draft; a reply that matches the raw context never builds it."""

from __future__ import annotations

import engine  # noqa: F401  (loads OpenBLAS before mlx)

# isort: split
import json

from engine.generation.speculation.lookup import LookupDrafter, json_escaper
from engine.model.tokenizer import Tokenizer

import pytest

FILE = ('def total(items):\n    """Sum of "price" fields."""\n    s = 0\n    for it in items:\n'
        '        s += it["price"]\n    return s\n\n\ndef count(items):\n    return len(items)\n')


@pytest.fixture(scope="module")
def tok(tiny_llama_dir):
    return Tokenizer.from_hf_dir(tiny_llama_dir)


def _drafter(tok, context_text, reply_text, escaped=True, calls=None):
    def esc(tokens):
        if calls is not None:
            calls.append(len(tokens))
        return json_escaper(tok)(tokens)

    # the tiny tokenizer is nearly one token per character: n-grams up to 8 to be unique
    d = LookupDrafter(2, 8, esc if escaped else None)
    d.reset(tok.encode(context_text))
    reply = tok.encode(reply_text)
    d.commit(reply[:-1])
    return d, reply[-1]


@pytest.mark.parametrize("cut", [40, 75, 120])
def test_an_edit_file_string_is_drafted_from_the_escaped_context(tok, cut):
    body = json.dumps(FILE)[1:-1]
    reply = '<tool_call>\n{"name": "edit_file", "arguments": {"path": "a.py", "old_text": "' + body[:cut]
    context = "<tool>\n" + FILE + "</tool>\n"
    with_esc, pending = _drafter(tok, context, reply)
    draft = with_esc.propose(pending, 8)
    assert len(draft) == 8
    assert body[cut:].startswith(tok.decode(draft))  # the next 8 tokens of the escaped copy
    raw_only, pending = _drafter(tok, context, reply, escaped=False)
    assert tok.decode(raw_only.propose(pending, 8)) != tok.decode(draft)


def test_a_raw_copy_never_builds_the_escaped_index(tok):
    calls: list[int] = []
    context = "Repeat:\n" + FILE
    d, pending = _drafter(tok, context, FILE[:60], calls=calls)
    draft = d.propose(pending, 6)
    assert FILE[60:].startswith(tok.decode(draft)) and len(draft) == 6
    assert calls == []  # a full-length longest match: the escaped tokens were not needed


def test_a_miss_builds_the_escaped_index_once_and_drafts_nothing(tok):
    calls: list[int] = []
    d, pending = _drafter(tok, "<tool>\n" + FILE + "</tool>\n", "zqxj vwk", calls=calls)
    assert d.propose(pending, 6) == []
    d.commit([pending])
    assert d.propose(tok.encode("q")[0], 6) == []
    assert len(calls) == 1
