"""The oracle judges a sample drawn on a seed its replica drew by that seed. An engine server is
sent a seed drawn for every unseeded request (the replay coordinate records it), so campaign 7's
sglang replicas' answers, and loop samples they made, were recomputed as unseeded and flagged
``served``. A recorded seed is no licence: the tokens must still be what the labelled version's
weights make under it."""

from __future__ import annotations

from reliability.adversary.journal import seed_used
from reliability.adversary.oracle_loop import drawn_streams, span_misfits
from rollfleet.workers.engines.keyed import VOCAB, keyed_tokens

KEYS = {3: b"k" * 16, 4: b"j" * 16}
PROMPT = [5, 17, 301, 9]


def test_the_seed_used_is_the_requests_else_the_one_its_coordinate_records() -> None:
    drawn = {"replay": {"sampling": {"seed": 987654321}}}
    assert seed_used({"seed": 7}, drawn) == 7
    assert seed_used({}, drawn) == 987654321
    assert seed_used({}, {"replay": {"sampling": {"seed": None}}}) is None
    assert seed_used({}, {}) is None  # (an answer without a coordinate: unseeded)


def _sample(seed: int, count: int, key: bytes) -> list[int]:
    return keyed_tokens(key, PROMPT, count, seed=seed, sample=0, vocab=VOCAB)


def test_a_loop_sample_made_on_a_drawn_seed_fits_that_stream_and_no_other() -> None:
    tokens = _sample(1234, 6, KEYS[3])
    spans = [[3, 0, 6, "s1"]]
    keyed = lambda replica: True  # noqa: E731
    drawn = drawn_streams([[0, 0, 1234]])
    assert drawn is not None
    assert span_misfits(KEYS.__getitem__, PROMPT, tokens, spans, (None, 0), keyed, drawn) == [-1]
    # As unseeded (what the oracle did before), the same tokens misfit from the first.
    assert span_misfits(KEYS.__getitem__, PROMPT, tokens, spans, (None, 0), keyed) == [0]
    # A lie about the seed does not pass them: another seed's stream, or another version's weights.
    assert span_misfits(KEYS.__getitem__, PROMPT, tokens, spans, (None, 0), keyed, drawn_streams([[0, 0, 99]])) == [0]
    assert span_misfits(KEYS.__getitem__, PROMPT, tokens, [[4, 0, 6, "s1"]], (None, 0), keyed, drawn) == [0]


def test_each_run_of_a_continued_sample_is_judged_by_the_stream_its_replica_drew() -> None:
    """A continuation is a job of its own (its own drawn seed); a run that drew none (an echo
    replica, unseeded) is judged by the group's own streams."""
    first = keyed_tokens(KEYS[3], PROMPT, 4, seed=None, sample=0, vocab=VOCAB)
    rest = keyed_tokens(KEYS[4], PROMPT + first, 3, seed=555 + 1, sample=0, vocab=VOCAB)
    tokens, spans = first + rest, [[3, 0, 4, "w1"], [4, 4, 7, "s1"]]
    drawn = drawn_streams([[0, 0, None], [4, 1, 555]])  # sample 1 of the continuation's answer
    assert drawn is not None and drawn(0) is None and drawn(5) == (556, 0)
    keyed = lambda replica: True  # noqa: E731
    assert span_misfits(KEYS.__getitem__, PROMPT, tokens, spans, (None, 0), keyed, drawn) == [-1, -1]
    assert drawn_streams([[0, 0, None]]) is None


def test_one_span_joining_two_runs_is_judged_token_by_token() -> None:
    """Campaign 7 (engines, seed 1): a run made tokens [0, 112) at v0 then v1, the loop continued
    the sample from 112 at v1 on the same replica, and the sample's spans joined them into one
    span [105, 214) at v1; each of its tokens is judged by the run that made it."""
    first = keyed_tokens(KEYS[3], PROMPT, 6, seed=11, sample=0, vocab=VOCAB)
    rest = keyed_tokens(KEYS[3], PROMPT + first, 4, seed=22, sample=0, vocab=VOCAB)
    drawn = drawn_streams([[0, 0, 11], [6, 0, 22]])
    keyed = lambda replica: True  # noqa: E731
    got = span_misfits(KEYS.__getitem__, PROMPT, first + rest, [[3, 0, 10, "w2"]], (None, 0), keyed, drawn)
    assert got == [-1]


def test_a_run_that_made_nothing_gives_way_to_the_next_at_the_same_offset() -> None:
    """Campaign 8, seed 99: sample 1 of a job of four was aborted before its first token and
    continued from offset 0 by a job of its own; both runs start at 0, the later made them all."""
    tokens = _sample(4423820359866001532, 5, KEYS[3])
    drawn = drawn_streams([[0, 1, 1469226431842401052], [0, 0, 4423820359866001532]])
    keyed = lambda replica: True  # noqa: E731
    assert span_misfits(KEYS.__getitem__, PROMPT, tokens, [[3, 0, 5, "w2"]], (None, 0), keyed, drawn) == [-1]
