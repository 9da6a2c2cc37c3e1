"""The n-gram (prompt-lookup) proposer on exact token lists: the longest n first, the latest earlier occurrence, the
tokens that followed it, and never a match that straddles token boundaries."""

from array import array

import pytest

from scheduler_svc.core.ngram import propose


def test_the_last_tokens_earlier_occurrence_proposes_what_followed_it():
    assert propose([1, 2, 3, 4, 5, 6, 1, 2], 3, 4, 2) == [3, 4, 5]
    assert propose(array("i", [1, 2, 3, 4, 5, 6, 1, 2]), 3, 4, 2) == [3, 4, 5]  # a Request's tokens


def test_the_longest_n_wins_over_a_later_shorter_match():
    # [7, 1, 2] occurs at 0 (followed by 30); [1, 2] alone occurs later too (followed by 40)
    assert propose([7, 1, 2, 30, 9, 1, 2, 40, 7, 1, 2], 2, 3, 2) == [30, 9]
    assert propose([7, 1, 2, 30, 9, 1, 2, 40, 7, 1, 2], 2, 2, 2) == [40, 7]  # n = 2 only: the latest [1, 2]


def test_the_latest_occurrence_wins_among_equally_long_ones():
    assert propose([1, 2, 10, 1, 2, 20, 1, 2], 1, 2, 2) == [20]


def test_a_proposal_stops_at_the_sequence_end_and_may_run_into_the_suffix():
    assert propose([5, 6, 5, 6], 4, 2, 2) == [5, 6]  # [5, 6] at 0 is followed by the suffix itself
    assert propose([9, 9, 9], 4, 2, 1) == [9]


def test_no_proposal_without_an_earlier_occurrence_of_at_least_min_n_tokens():
    assert propose([1, 2, 3, 4, 5], 4, 4, 1) == []
    assert propose([1, 2, 3, 9, 2, 3, 7, 3], 4, 4, 2) == []  # only [3] recurs, shorter than min_n
    assert propose([1, 2, 3, 9, 2, 3, 7, 3], 4, 4, 1) == [7, 3]  # the latest earlier [3]: at 5
    assert propose([1, 2, 1, 2], 0, 2, 2) == []  # no room
    assert propose([1, 2], 4, 2, 2) == []  # too short to hold an earlier 2-gram


def test_a_byte_match_across_token_boundaries_is_no_match():
    # As int32 bytes (little-endian), [256, 1] holds 00 01 00 00 01 00 00 00: the last token 1's bytes 01 00 00 00
    # also occur at byte offset 1, inside 256. Only a whole earlier token 1 counts.
    assert propose([256, 0, 5, 1], 2, 1, 1) == []
    assert propose([256, 0, 1, 5, 1], 2, 1, 1) == [5, 1]
    assert propose([1 << 8, 1 << 16, 1 << 24, 1, 1 << 16, 1 << 24, 1], 1, 2, 2) == [1 << 16]


@pytest.mark.parametrize("max_n", [1, 2, 3, 4, 6])
def test_every_proposal_is_what_followed_an_earlier_occurrence(max_n):
    import random
    rng = random.Random(max_n)
    for _ in range(300):
        tokens = [rng.randrange(0, 4) * rng.choice([1, 256, 65536]) for _ in range(rng.randint(1, 40))]
        got = propose(tokens, 3, max_n, 1)
        # brute force: the longest n, then the latest start
        want = []
        for n in range(min(max_n, len(tokens) - 1), 0, -1):
            starts = [s for s in range(len(tokens) - n) if tokens[s:s + n] == tokens[-n:]]
            if starts:
                want = tokens[starts[-1] + n:starts[-1] + n + 3]
                break
        assert got == want, tokens
