"""Drafts looked up in the context: the longest, latest earlier match, its followers continued periodically."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from eaglewire.engine.context_lookup import LookupShape, lookup_drafts
from eaglewire.errors import ConfigError


def reference(context: list[int], shape: LookupShape, limit: int) -> list[int]:
    """The definition, by brute force: the longest match first, then the latest occurrence of it."""
    count, length = min(shape.max_drafts, limit), len(context)
    if count < 1:
        return []
    for matched in range(min(shape.longest_match, length - 1), shape.min_match - 1, -1):
        suffix = context[length - matched:]
        for start in range(length - matched - 1, -1, -1):  # at least one token must follow the occurrence
            if context[start:start + matched] == suffix:
                followers = context[start + matched:]
                return [followers[i % len(followers)] for i in range(count)]
    return []


def test_the_longest_match_wins_over_a_later_shorter_one():
    # "2 3" occurs at 1 (after "1") and at 5 (after "9"); the context ends "1 2 3": the earlier, longer match wins
    context = [1, 2, 3, 4, 9, 2, 3, 7, 1, 2, 3]
    assert lookup_drafts(context, LookupShape(min_match=2, max_drafts=3), 10) == [4, 9, 2]


def test_among_equally_long_matches_the_latest_wins():
    context = [1, 2, 7, 1, 2, 8, 3, 1, 2]
    assert lookup_drafts(context, LookupShape(min_match=2, max_drafts=2), 10) == [8, 3]


def test_followers_that_reach_the_end_continue_periodically():
    # a loop shorter than the drafts: "5 5 5" is followed by 5 forever, "a b a b" by "a b ..."
    assert lookup_drafts([5, 5, 5, 5], LookupShape(min_match=2, max_drafts=6), 10) == [5] * 6
    assert lookup_drafts([1, 2, 1, 2], LookupShape(min_match=2, max_drafts=5), 10) == [1, 2, 1, 2, 1]


def test_no_drafts_without_an_earlier_occurrence_or_room():
    shape = LookupShape(min_match=2, max_drafts=4)
    assert lookup_drafts([1, 2, 3, 4, 5], shape, 10) == []
    assert lookup_drafts([1, 2], shape, 10) == []  # too short to hold a match and a follower
    assert lookup_drafts([1, 2, 1, 2], shape, 0) == []  # no room left
    assert len(lookup_drafts([1, 2, 1, 2], shape, 1)) == 1  # the limit caps max_drafts


@pytest.mark.parametrize("bad", [dict(min_match=0), dict(min_match=17), dict(max_drafts=0)])
def test_refuses_a_shape_out_of_range(bad):
    with pytest.raises(ConfigError, match="lookup: "):
        LookupShape(**bad)


@settings(max_examples=300, deadline=None)
@given(context=st.lists(st.integers(0, 3), max_size=40), min_match=st.integers(1, 4),
       longest=st.integers(4, 8), drafts=st.integers(1, 7), limit=st.integers(0, 8))
def test_agrees_with_the_brute_force_definition(context, min_match, longest, drafts, limit):
    shape = LookupShape(min_match=min_match, max_drafts=drafts, longest_match=longest)
    assert lookup_drafts(context, shape, limit) == reference(context, shape, limit)
