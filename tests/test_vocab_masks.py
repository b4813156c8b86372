"""engine.generation.vocab_masks on its own: a tiny byte grammar (one quoted string), no agents."""

from engine.generation.vocab_masks import DEAD, GrammarMasks, TokenTable, table_width

import numpy as np

QUOTE = 0x22
PIECES = ['"', '""', '"a', 'ab', 'b"', '"x', 'a"b', "\\", "c", "a\\", '"' + "\\"]
EOS = len(PIECES)  # one special end-of-turn id after the pieces


class QuotedString:
    """The language ``"<plain>*"``: states ``"start"``, ``"body"`` and the final ``()``."""

    plain_bytes = bytes(b for b in range(0x20, 0x7F) if b not in (QUOTE, 0x5C))

    def initial(self):
        return "start"

    def final(self):
        return ()

    def step(self, state, b):
        if state == "start":
            return "body" if b == QUOTE else None
        if state == "body":
            if b == QUOTE:
                return ()
            return "body" if b in self.plain_bytes else None
        return None

    def completion(self, state):
        return b'""' if state == "start" else b'"' if state == "body" else b""

    def plain_loop(self, state):
        return state == "body"


class Tok:
    vocab_size = EOS + 1
    special_ids = (EOS,)
    eos_ids = (EOS,)

    def piece(self, i):
        return PIECES[i] if i < len(PIECES) else "<end>"


def _masks(width=EOS + 4):
    return GrammarMasks(QuotedString(), TokenTable(Tok(), width))


def _brute(grammar, state, piece):
    for b in piece:
        if state == () or state is None:
            return False
        state = grammar.step(state, b)
    return state is not None


def test_masks_match_a_byte_by_byte_walk_of_every_token():
    m = _masks()
    for state in ("start", "body", ()):
        got = np.array(m.mask(m.intern(state)))
        want = [p is not None and _brute(m.grammar, state, p) for p in m.table.pieces]
        assert got.tolist() == want, state
    body = np.array(m.mask(m.intern("body")))
    assert body[PIECES.index("ab")] and body[PIECES.index('b"')] and not body[PIECES.index('a"b')]
    assert not body[PIECES.index("\\")] and not body[EOS] and not body[-1]  # special, padding


def test_budget_helpers_and_forced_text():
    m = _masks()
    start, body = m.intern("start"), m.intern("body")
    assert (m.need(start), m.need(body), m.need(m.accept)) == (1, 1, 0)  # '""' is one token
    assert np.flatnonzero(np.array(m.closing_mask(start))).tolist() == [PIECES.index('""')]
    assert m.forced(start, 0) == (b'"', body)  # only a quote can open the string
    assert m.forced(body, 0) == (b"", body)  # the model chooses the body
    assert m.walk(start, b'"ab"') == m.accept and m.walk(start, b'"ab"c') == DEAD
    assert np.flatnonzero(np.array(m.end_mask)).tolist() == [EOS]


def test_token_table_spelling_and_width():
    table = TokenTable(Tok(), EOS + 4)
    assert table.spell(b'"ab"') == (2, [PIECES.index('"a')])  # '"a' + 'b"'
    assert table.prefix_ids(b'"ab') == [PIECES.index('"'), PIECES.index('"a')]
    prefix, fully = table.plain_runs(QuotedString.plain_bytes)
    assert prefix[PIECES.index("a\\")] == 1 and not fully[PIECES.index("a\\")] and fully[PIECES.index("ab")]

    class Eng:
        tokenizer = Tok()
        logits_width = 0

    assert table_width(Eng()) == Tok.vocab_size
