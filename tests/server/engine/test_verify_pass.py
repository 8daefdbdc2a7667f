"""The verify pass: what each row feeds, which of it is scored, and a tree's layout."""

from __future__ import annotations

from kenspec.server.engine.verify_pass import PassRow, VerifyPass


def test_a_row_feeds_its_prompt_tail_then_the_pending_token_and_its_drafts() -> None:
    row = PassRow(cache_length=40, pending=9, drafts=(5, 7), prompt_tail=(3, 4))
    assert row.tokens == [3, 4, 9, 5, 7]
    assert row.scored == 3  # after 9, 5 and 7; the prompt tail's logits are not needed
    assert row.pending_position == 42
    assert row.draft_parents() == (-1, 0)  # a chain
    assert row.feed_parents() is None  # laid out as a sequence


def test_a_tree_row_lays_its_prompt_tail_and_pending_token_out_as_a_sequence() -> None:
    row = PassRow(
        cache_length=40, pending=9, drafts=(5, 6, 7), parents=(-1, -1, 1), prompt_tail=(3,)
    )
    assert row.feed_parents() == [-1, 0, 1, 1, 3]  # drafts at the root follow the pending token
    cut = row.prefix(2)
    assert (cut.drafts, cut.parents) == ((5, 6), (-1, -1))
    assert row.prefix(1).parents == (-1,)  # still laid out as the tree it was proposed as
    assert row.prefix(5) is row


def test_only_nodes_whose_slot_and_position_share_a_block_of_keys_are_kept() -> None:
    row = PassRow(cache_length=190, pending=1, drafts=(5, 6, 7), parents=(-1, -1, 0))
    assert row.nodes_in_key_blocks(192) == 1  # node 1 is written at 192 but is at 191
    assert row.nodes_in_key_blocks(1024) == 3
    chain = PassRow(cache_length=190, pending=1, drafts=(5, 6, 7))
    assert chain.nodes_in_key_blocks(192) == 3  # a chain's slots are its positions


def test_a_pass_of_sequences_scores_every_token() -> None:
    verify = VerifyPass.sequences([0, 5], [[1, 2, 3], [4]], width=6)
    assert [row.tokens for row in verify.rows] == [[1, 2, 3], [4]]
    assert [row.scored for row in verify.rows] == [3, 1]
    assert (verify.tokens, verify.width, verify.prefills) == (4, 6, False)
