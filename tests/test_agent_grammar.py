"""The tool-call grammar (byte level) and its mapping onto vocabularies (constrained decoding)."""

import json
import random

from engine.generation.vocab_masks import TokenTable

import numpy as np
import pytest

import tools
from agents.constrained import ToolCallConstraint, ToolCallMasks, force_from
from agents.grammar import ToolCallGrammar
from agents.parser import ToolCallParser
from agents.protocol import parse_call, tool_map
from agents.scripted import ByteTokenizer

SCHEMAS = tools.default_registry(".").schemas()
TOOLS = tool_map(SCHEMAS)
EXTRA = {
    "pick": {
        "type": "object",
        "properties": {
            "mode": {"type": "string", "enum": ["fast", "slow"], "description": "m"},
            "level": {"type": "integer", "enum": [1, 10, 100], "description": "l"},
            "tags": {"type": "array", "items": {"type": "string"}, "description": "t"},
            "counts": {"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 5}, "description": "c"},
            "flag": {"type": "boolean", "description": "f"},
        },
        "required": ["mode"],
        "additionalProperties": False,
    }
}


@pytest.fixture(scope="module")
def grammar():
    return ToolCallGrammar({**TOOLS, **EXTRA})


def accepts(g, text: str) -> bool:
    state = g.feed(g.initial(), text.encode())
    return state is not None and g.accepted(state)


def viable(g, text: str) -> bool:
    return g.feed(g.initial(), text.encode()) is not None


@pytest.mark.parametrize("text", [
    '{"name": "write_file", "arguments": {"path": "a.txt", "content": "hi"}}</tool_call>',
    '\n{"name":"write_file","arguments":{"content":"x\\n\\"q\\" \\u00e9","path":"a"}}\n</tool_call>',
    '{"name": "bash", "arguments": {"command": "ls", "timeout_s": 600}}</tool_call>',
    '{"name": "bash", "arguments": {"command": "ls", "timeout_s": 1}}</tool_call>',
    '{"name": "list_dir", "arguments": {}}</tool_call>',
    '{"name": "grep", "arguments": {"pattern": "x", "case_insensitive": false}}</tool_call>',
    '{"name": "pick", "arguments": {"mode": "slow", "level": 10, "tags": ["a", "b"], "counts": [-5, 0, 5], "flag": true}}</tool_call>',
    '{"name": "pick", "arguments": {"mode": "fast", "level": 1, "tags": [], "counts": []}}</tool_call>',
    '{"name": "write_file", "arguments": {"path": "é✓", "content": "日本"}}</tool_call>',
])
def test_accepts_valid_calls(grammar, text):
    assert accepts(grammar, text)
    body = text.replace("</tool_call>", "")
    name, args = parse_call(body, {**TOOLS, **EXTRA})
    assert name == json.loads(body)["name"]


@pytest.mark.parametrize("text", [
    '{"name": "bash", "arguments": {"command": "ls", "timeout_s": 601}}',  # above maximum
    '{"name": "bash", "arguments": {"command": "ls", "timeout_s": 0}}',  # below minimum
    '{"name": "bash", "arguments": {"command": "ls", "timeout_s": 07}}',  # leading zero
    '{"name": "bash", "arguments": {"command": "ls", "timeout_s": -1}}',
    '{"name": "bash", "arguments": {"command": "ls", "timeout_s": 1.5}}',
    '{"name": "bash", "arguments": {"timeout_s": 5}}',  # required command missing
    '{"name": "grep", "arguments": {"pattern": "x", "pattern": "y"}}',  # duplicate key
    '{"name": "grep", "arguments": {"pattern": "x", "foo": 1}}',  # unknown key
    '{"name": "grepx", "arguments": {}}',
    '{"arguments": {}, "name": "grep"}',  # name must come first
    '{"name": "read_file", "arguments": {"path": "a\nb"}}',  # raw control character
    '{"name": "read_file", "arguments": {"path": "a\\x"}}',  # bad escape
    '{"name": "pick", "arguments": {"mode": "medium"}}',  # not in enum
    '{"name": "pick", "arguments": {"mode": "fast", "level": 5}}',
    '{"name": "pick", "arguments": {"mode": "fast", "counts": [6]}}',
    '{"name": "pick", "arguments": {"mode": "fast", "flag": 1}}',
    '{"name": "list_dir", "arguments": {}}      \n\n</tool_call>',  # whitespace run too long
])
def test_rejects_invalid_calls(grammar, text):
    assert not accepts(grammar, text + ("" if text.endswith("</tool_call>") else "</tool_call>"))


def test_nothing_after_the_close_marker(grammar):
    assert accepts(grammar, '{"name": "list_dir", "arguments": {}}</tool_call>')
    assert not viable(grammar, '{"name": "list_dir", "arguments": {}}</tool_call>x')


@pytest.mark.parametrize("prefix", [
    "", '\n{"na', '{"name": "bash", "arguments": {"command": "ls -l',
    '{"name": "bash", "arguments": {"timeout_s": 4', '{"name": "write_file", "arguments": {"content": "x\\u00',
    '{"name": "pick", "arguments": {"mode": "fa', '{"name": "pick", "arguments": {"tags": ["a", "b',
    '{"name": "pick", "arguments": {"mode": "fast", "counts": [-', '{"name": "pick", "arguments": {"level": 1',
    '{"name": "list_dir", "arguments": {"depth": 2} ',
])
def test_completion_finishes_any_prefix(grammar, prefix):
    state = grammar.feed(grammar.initial(), prefix.encode())
    assert state is not None
    tail = grammar.completion(state)
    assert accepts(grammar, prefix + tail.decode())


def test_completion_is_consistent_byte_by_byte(grammar):
    """The wind-up follows completion(); after each byte the rest must be the new completion."""
    state = grammar.feed(grammar.initial(), b'{"name": "edit_file", "arguments": {"path": "a')
    tail = grammar.completion(state)
    for i, b in enumerate(tail):
        state = grammar.step(state, b)
        assert grammar.completion(state) == tail[i + 1:]


class PieceTokenizer:
    """A vocabulary of multi-byte pieces (like BPE): every byte plus tokens that span JSON
    structure, so masks must handle tokens crossing string and key boundaries."""

    EXTRA = ['<tool_call>', '</tool_call>', '<tool', '_call', '>{"', '{"', '"}', '"}}', '}}', '",', '": "',
             '":', ' "', 'name', '"name"', 'write_file', '"bash"', 'arguments', '"arguments": {"', 'hello',
             ' world', 'hello world', '.txt', 'content', 'path', 'command', '\n', '\n\n\n\n\n', '  ', '\\n',
             '\\"', '"\n', 'true', 'false', '60', '600', '6000', '{"x', '<|im_end|>']

    def __init__(self):
        self.pieces = [bytes((b,)) for b in range(256)] + [p.encode() for p in self.EXTRA]
        self.special_ids = frozenset({len(self.pieces) - 1})
        self.eos_ids = {len(self.pieces) - 1}

    @property
    def vocab_size(self):
        return len(self.pieces)

    def piece(self, i):
        return self.pieces[i]

    def encode_greedy(self, text: str) -> list[int]:
        data, out, i = text.encode(), [], 0
        by = {p: n for n, p in enumerate(self.pieces) if n not in self.special_ids}
        while i < len(data):
            size = max(s for s in range(1, 20) if data[i:i + s] in by)
            out.append(by[data[i:i + size]])
            i += size
        return out


@pytest.fixture(scope="module", params=["bytes", "pieces"])
def masks(request):
    tok = ByteTokenizer() if request.param == "bytes" else PieceTokenizer()
    width = tok.vocab_size + 7  # padded logits, as real models have
    return ToolCallMasks(ToolCallGrammar(TOOLS), TokenTable(tok, width))


def _drive(masks, rng, max_tokens, force_call, temperature_like=0.5):
    """A random "model": picks any allowed token (mostly prose-like when free)."""
    c = ToolCallConstraint(masks, force_call=force_call, max_tokens=max_tokens)
    out = []
    table = masks.table
    for _ in range(max_tokens):
        mask = c.allowed()
        if mask is None:
            choices = np.flatnonzero(table.valid)
        else:
            m = np.array(mask)
            assert m.shape == (table.width,)
            choices = np.flatnonzero(m)
        assert len(choices), f"no token allowed in phase {c.phase}"
        tok = int(rng.choice(choices))
        c.advance(tok)
        if tok in table.eos:
            break
        out.append(table.pieces[tok] or b"")
    return c, b"".join(out).decode("utf-8", errors="replace")


def test_random_model_under_constraint_always_emits_valid_calls(masks):
    rng = np.random.default_rng(0)
    for trial in range(60):
        budget = int(rng.integers(masks.min_call_tokens + 2, masks.min_call_tokens + 140))
        c, text = _drive(masks, rng, max_tokens=budget, force_call=True)
        assert c.calls == 1 and c.phase == "end", (trial, text)
        parser = ToolCallParser(TOOLS)
        parser.feed(text)
        parser.finish()
        assert not parser.malformed and len(parser.calls) == 1, (trial, text)
        call = parser.calls[0]
        tools.schema.validate_args(call.name, TOOLS[call.name], call.arguments)


def test_tight_budget_blocks_calls_that_could_not_finish(masks):
    rng = np.random.default_rng(1)
    c, text = _drive(masks, rng, max_tokens=masks.min_call_tokens, force_call=True)
    assert "</tool_call>" not in text and c.calls == 0
    c, text = _drive(masks, rng, max_tokens=masks.min_call_tokens + 1, force_call=True)
    assert c.calls == 1 and text.endswith("</tool_call>")


def test_free_text_is_unconstrained_until_the_marker(masks):
    table = masks.table
    c = ToolCallConstraint(masks, max_tokens=500)
    first = np.array(c.allowed())  # the first token: a bare "{" must start a valid call
    assert first[ord("S")] and first[ord("{")] and first[ord("<")]
    for b in b"Sure, ":
        c.advance(b)
    assert c.allowed() is None and c.phase == "free"
    c.advance(ord("<"))
    assert c.phase == "marker"  # "<" might open a call: tokens finishing it into bad JSON go
    mask = np.array(c.allowed())
    assert mask[ord("t")] and mask[ord(" ")]  # "<table>" or "a < b" stay possible
    for b in b"tool_":
        c.advance(b)
    mask = np.array(c.allowed())  # from "<tool_" on the marker is forced
    assert mask[ord("c")] and not mask[ord("s")] and not mask[ord(" ")]
    for b in b"call>":
        c.advance(b)
    assert c.phase == "call"
    mask = np.array(c.allowed())
    assert mask[ord("{")] and mask[ord("\n")] and not mask[ord("x")]
    assert not mask[table.eos].any()


def test_special_tokens_never_appear_inside_calls(masks):
    c = ToolCallConstraint(masks, max_tokens=500)
    for b in b'<tool_call>{"name": "bash", "arguments": {"command": "ab':
        c.advance(b)
    mask = np.array(c.allowed())
    assert not mask[masks.table.eos].any()
    assert not mask[masks.table.width - 1]  # padding beyond the tokenizer


def test_marker_force_threshold():
    assert force_from("<tool_call>") == len("<tool_")
    assert force_from("<call>") == len("<call>")


def test_multibyte_tokens_across_boundaries():
    tok = PieceTokenizer()
    masks = ToolCallMasks(ToolCallGrammar(TOOLS), TokenTable(tok, tok.vocab_size))
    text = '<tool_call>{"name": "write_file", "arguments": {"content": "hello world", "path": "a.txt"}}</tool_call>'
    ids = tok.encode_greedy(text)
    assert len(ids) < len(text) / 2  # really multi-byte
    c = ToolCallConstraint(masks, max_tokens=200)
    for i in ids:
        mask = c.allowed()
        assert mask is None or bool(np.array(mask)[i]), tok.pieces[i]
        c.advance(i)
    assert c.phase == "end"
    bad = ToolCallConstraint(masks, max_tokens=200)
    for i in tok.encode_greedy('<tool_call>{"name": "write_file", "arguments": {"content": "hello'):
        bad.advance(i)
    mask = np.array(bad.allowed())
    by = {p: n for n, p in enumerate(tok.pieces)}
    assert mask[by[b'"}}']] is np.False_  # path is required: the object cannot close yet
    assert mask[by[b'",']] and mask[by[b" world"]] and mask[by[b"\\n"]] and not mask[by[b"\n"]]


def test_masks_are_cached_per_state():
    tok = ByteTokenizer()
    masks = ToolCallMasks(ToolCallGrammar(TOOLS), TokenTable(tok, tok.vocab_size))
    c = ToolCallConstraint(masks, max_tokens=400)
    for b in b'<tool_call>{"name": "bash", "arguments": {"command": "':
        c.advance(b)
    first = c.allowed()
    built = masks.mask_ms
    for b in b"echo hi there":
        c.advance(b)
        assert c.allowed() is first  # same string-body state: same cached mask object
    assert masks.mask_ms == built


def test_grammar_rejects_random_garbage_quickly():
    g = ToolCallGrammar(TOOLS)
    rng = random.Random(3)
    for _ in range(200):
        junk = bytes(rng.randrange(256) for _ in range(12))
        state = g.feed(g.initial(), junk)
        assert state is None or not g.accepted(state)


def test_a_reply_starting_with_a_brace_is_a_call_without_marker():
    tok = PieceTokenizer()
    masks = ToolCallMasks(ToolCallGrammar(TOOLS), TokenTable(tok, tok.vocab_size))
    by = {p: n for n, p in enumerate(tok.pieces)}
    first = np.array(ToolCallConstraint(masks, max_tokens=300).allowed())
    assert first[by[b'{"']] and first[by[b"hello"]]
    assert not first[by[b'{"x']]  # a bare call must start {"name"
    c = ToolCallConstraint(masks, max_tokens=300)
    for i in tok.encode_greedy('{"name": "list_dir", "arguments": {}}'):
        c.advance(i)
    assert c.phase == "call"
    mask = np.array(c.allowed())
    assert not mask[tok.eos_ids.pop()]  # the close marker has to come first
    assert mask[by[b"</tool_call>"]] and mask[by[b"\n"]]
    off = ToolCallConstraint(masks, max_tokens=300, bare_calls=False)
    assert off.allowed() is None


@pytest.fixture(scope="module", params=["bytes", "pieces"])
def pick_masks(request):
    tok = ByteTokenizer() if request.param == "bytes" else PieceTokenizer()
    return ToolCallMasks(ToolCallGrammar(EXTRA), TokenTable(tok, tok.vocab_size + 7))


def test_random_model_under_constraint_emits_valid_enum_and_array_arguments(pick_masks):
    """The fuzz above over a schema of enums (string and integer) and arrays (of strings and of
    bounded integers): every call validates, and over the trials every enum value, empty and
    non-empty arrays, and both ends of the integer range turn up (so a grammar that only ever
    allowed one safe shape would fail)."""
    rng = np.random.default_rng(3)
    seen = {"mode": set(), "level": set(), "tags": set(), "counts": set(), "flag": set()}
    lengths = {"tags": set(), "counts": set()}
    for trial in range(150):
        budget = int(rng.integers(pick_masks.min_call_tokens + 2, pick_masks.min_call_tokens + 160))
        c, text = _drive(pick_masks, rng, max_tokens=budget, force_call=True)
        assert c.calls == 1 and c.phase == "end", (trial, text)
        parser = ToolCallParser(EXTRA)
        parser.feed(text)
        parser.finish()
        assert not parser.malformed and len(parser.calls) == 1, (trial, text)
        call = parser.calls[0]
        args = tools.schema.validate_args(call.name, EXTRA["pick"], call.arguments)
        assert args["mode"] in ("fast", "slow")
        for key, value in call.arguments.items():
            if isinstance(value, list):
                lengths[key].add(min(len(value), 2))
                seen[key].update(value)
            else:
                seen[key].add(value)
        assert all(-5 <= n <= 5 and isinstance(n, int) for n in call.arguments.get("counts", []))
        assert all(isinstance(s, str) for s in call.arguments.get("tags", []))
    assert seen["mode"] == {"fast", "slow"} and seen["level"] == {1, 10, 100}
    assert seen["flag"] == {True, False}
    assert lengths == {"tags": {0, 1, 2}, "counts": {0, 1, 2}}
    assert {-5, 5} <= seen["counts"]


# -- forced drafts (speculative decoding under the grammar) ------------------------------------
def _constraint_after(masks, text: str) -> ToolCallConstraint:
    c = ToolCallConstraint(masks, force_call=True)
    for t in ByteTokenizer().encode("<tool_call>" + text):
        assert c.allowed() is not None
        c.advance(t)
    return c


@pytest.fixture(scope="module")
def byte_masks():
    tok = ByteTokenizer()
    return ToolCallMasks(ToolCallGrammar(TOOLS), TokenTable(tok, tok.vocab_size + 7))


@pytest.mark.parametrize("text, forced", [
    ('{"name": "write_file", "arguments": {"path": "a.txt"', ', "content": "'),  # the only key left
    ('{"name": "write_file", "arguments": {"path": "a.txt",', ' "content": "'),
    ('{"name": "write_file", "arguments": {"path": "a.txt", "c', 'ontent": "'),
    ('{"name": "write_file", "arguments": {"content": "x", "path": "a.txt"', '}}</tool_call>'),
    ('{"name": "edit_file", "arguments": {"path": "a", "old_text": "x"', ', "'),  # new_text or replace_all
    ('{"name": "edit_file", "arguments": {"path": "a", "old_text": "x", "new_text": "y", "r', 'eplace_all":'),
    ('{"name": "edit_file", "arguments": {"replace_all": false, "path": "a", "old_text": "x"', ', "new_text": "'),
    ('{"name": "edit_file", "arguments": {"path": "a", "old_text": "x", "new_text": "y", "replace_all": true',
     '}}</tool_call>'),
    ('{"name": "edit_file", "arguments": {"path": "a", "old_text": "x", "new_text": "y"', ''),  # , or }
    ('{"name": "edit_file", "arguments": {"path": "a", "old_text": "x", "', ''),  # new_text or replace_all
    ('{"name": "write_file", "arguments": {"path": "a.t', ''),  # a string body: the model's text
    ('{"name": "bash", "arguments": {"command": "ls", "timeout_s": 6', ''),  # more digits or not
    ('{"name": "write_', 'file", "arguments": {"'),
])
def test_forced_draft_is_what_the_grammar_dictates(byte_masks, text, forced):
    """draft() spells exactly the bytes the grammar leaves no choice about (JSON spaced as models
    write it); feeding them keeps the call valid, and each is allowed by its position's mask."""
    c = _constraint_after(byte_masks, text)
    draft = c.draft(64)
    assert bytes(draft).decode() == forced
    fork = c.fork()
    for t in draft:
        assert bool(np.array(fork.allowed())[t])
        fork.advance(t)
    assert fork.phase in ("call", "end")
    assert c.draft(3) == draft[:3]  # a budget cuts it


def test_forced_draft_ends_with_the_end_token_the_model_used(byte_masks):
    tok = ByteTokenizer()
    c = _constraint_after(byte_masks, '{"name": "list_dir", "arguments": {}')
    assert bytes(c.draft(64)) == b"}</tool_call>"  # no end token known yet
    done = _constraint_after(byte_masks, '{"name": "list_dir", "arguments": {}}</tool_call>')
    assert done.phase == "end" and done.draft(4) == []
    done.advance(tok.specials["<|im_end|>"])
    assert byte_masks.end_token == tok.specials["<|im_end|>"]
    assert c.draft(64) == list(b"}</tool_call>") + [tok.specials["<|im_end|>"]]
    assert _constraint_after(byte_masks, '{"name": "list_dir", "arguments": {}}</tool_call>').draft(4) == [
        tok.specials["<|im_end|>"]]
    assert c.draft(0) == [] and ToolCallConstraint(byte_masks).draft(8) == []  # free text: nothing


def test_random_calls_every_forced_draft_is_the_only_way_on(byte_masks):
    """Along random valid calls, a forced draft's bytes are each the only non-whitespace byte
    the grammar allows there (so a model that writes compact or spaced JSON is drafted right)."""
    rng = np.random.default_rng(3)
    g = byte_masks.grammar
    for _ in range(20):
        c, text = _drive(byte_masks, rng, max_tokens=120, force_call=True)
        state = g.initial()
        for i in range(len(text)):
            state = g.step(state, text.encode()[i]) if state is not None else None
            if state is None or not state:
                break
            forced, _ = byte_masks.forced(byte_masks.intern(state), text.encode()[i])
            s = state
            for b in forced:
                options = {x for x in range(256) if g.step(s, x) is not None} - set(b" \t\n\r")
                assert b == 0x20 or options == {b}, (text[: i + 1], forced)
                s = g.step(s, b)
                assert s is not None
