"""N-gram proposer: the longest suffix n-gram's earliest occurrence gives the drafts (as vLLM)."""

from __future__ import annotations

from engine.spec_decode.ngram_proposer import NgramProposer


def test_drafts_what_followed_the_suffix():
    proposer = NgramProposer(3, 1, 3)
    assert proposer.propose([1, 2, 3, 4, 5, 6, 2, 3]) == [4, 5, 6]


def test_longest_n_wins_over_a_later_shorter_match():
    proposer = NgramProposer(2, 1, 3)
    # "3" alone last occurred before 9; "2 3" occurred before 4 5.
    assert proposer.propose([2, 3, 4, 5, 3, 9, 2, 3]) == [4, 5]


def test_earliest_occurrence_of_the_same_n():
    proposer = NgramProposer(1, 2, 2)
    assert proposer.propose([7, 8, 1, 7, 8, 2, 7, 8]) == [1]


def test_drafts_stop_at_the_known_tokens_and_the_limit():
    proposer = NgramProposer(4, 1, 2)
    assert proposer.propose([5, 6, 7, 5, 6]) == [7, 5, 6]
    assert proposer.propose([5, 6, 7, 5, 6], max_drafts=1) == [7]
    assert proposer.propose([5, 6, 7, 5, 6], max_drafts=0) == []


def test_no_match_no_drafts():
    proposer = NgramProposer(3, 2, 4)
    assert proposer.propose([1, 2, 3, 4, 5]) == []
    assert proposer.propose([1, 2]) == []
    assert proposer.propose([]) == []
