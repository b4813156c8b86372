from engine.generation.textstream import ReasoningSplitter, StopMatcher


def _feed_all(matcher, pieces):
    out = "".join(matcher.feed(p) for p in pieces)
    return out + matcher.flush()


def test_stop_string_split_across_chunks():
    m = StopMatcher(["\nUser:"])
    assert _feed_all(m, ["Hello", " there\n", "Us", "er: more"]) == "Hello there"
    assert m.stopped == "\nUser:"


def test_partial_stop_prefix_is_released_when_it_diverges():
    m = StopMatcher(["STOP"])
    assert m.feed("ab ST") == "ab "
    assert m.feed("ART") == "START"
    assert m.flush() == ""
    assert m.stopped is None


def test_earliest_of_several_stops_wins():
    m = StopMatcher(["world", "lo w"])
    assert _feed_all(m, ["hello world"]) == "hel"


def test_no_stops_passes_through():
    m = StopMatcher([])
    assert m.feed("abc") == "abc"


def _split_all(s, pieces):
    out = []
    for p in pieces:
        out += s.feed(p)
    out += s.flush()
    merged: list[list[str]] = []
    for kind, text in out:
        if merged and merged[-1][0] == kind:
            merged[-1][1] += text
        else:
            merged.append([kind, text])
    return [tuple(x) for x in merged]


def test_reasoning_block_split_across_chunks():
    s = ReasoningSplitter()
    pieces = ["<th", "ink>let me", " think</", "think>", "Answer: 4"]
    assert _split_all(s, pieces) == [("reasoning", "let me think"), ("content", "Answer: 4")]


def test_template_opened_reasoning():
    s = ReasoningSplitter(in_reasoning=True)
    assert _split_all(s, ["hmm", "</think>", "ok"]) == [("reasoning", "hmm"), ("content", "ok")]


def test_lone_angle_bracket_is_content():
    s = ReasoningSplitter()
    assert _split_all(s, ["a < b", " and <t", "able>"]) == [("content", "a < b and <table>")]
