"""Prompts that begin like an earlier one copy its keys/values instead of computing them."""

from __future__ import annotations

import pytest
import torch

from kenspec.server.engine.batch import Batch
from kenspec.server.engine.intake import BatchSettings
from kenspec.server.engine.prefix_cache import PrefixCache, _shared_length
from kenspec.server.engine.target import TargetModel
from tests.server.engine.drafts import Collector, reference_greedy, start

SYSTEM = "You are a helpful assistant. Answer briefly. "


def _cache_with(target: TargetModel, prompt: list[int]):
    cache = target.new_cache(rows=2)
    target.prefill(cache, 0, 0, prompt)
    return cache


def test_the_longest_shared_beginning_is_matched_and_copied_exactly(tiny_target) -> None:
    first = tiny_target.encode_prompt(SYSTEM + "The quick brown fox")
    second = tiny_target.encode_prompt(SYSTEM + "The lazy dog")
    cache = _cache_with(tiny_target, first)
    prefixes = PrefixCache(max_bytes=1 << 20)
    prefixes.store(cache, 0, first)
    prefix, length = prefixes.match(second)
    shared = next(i for i, (a, b) in enumerate(zip(first, second, strict=False)) if a != b)
    assert prefix is not None and length == shared > len(SYSTEM) // 2
    # Copied into row 1, the shared positions hold what computing them gives.
    cache.write(1, [k[:, :length] for k in prefix.keys], [v[:, :length] for v in prefix.values])
    fresh = _cache_with(tiny_target, second[:length])
    copied_keys, copied_values = cache.read(1, length)
    computed_keys, computed_values = fresh.read(0, length)
    pairs = zip(copied_keys + copied_values, computed_keys + computed_values, strict=True)
    for copied, computed in pairs:
        torch.testing.assert_close(copied, computed)


def test_short_matches_are_not_reused_and_old_prompts_are_evicted_first(tiny_target) -> None:
    prompts = [tiny_target.encode_prompt(f"{word} {SYSTEM}") for word in ("one", "two", "six")]
    per_position = _cache_with(tiny_target, prompts[0]).bytes_per_position
    assert per_position == 2 * 2 * 2 * 8 * 4  # layers x (k, v) x kv_heads x head_dim x fp32
    prefixes = PrefixCache(max_bytes=(2 * len(prompts[0]) + 1) * per_position, min_match=8)
    for prompt in prompts[:2]:
        prefixes.store(_cache_with(tiny_target, prompt), 0, prompt)
    assert prefixes.match(prompts[0][:7]) == (None, 0)  # fewer than min_match tokens
    assert prefixes.match(prompts[2]) == (None, 0)  # shares only a few first tokens
    prefixes.match(prompts[0])  # used: now the most recent
    prefixes.store(_cache_with(tiny_target, prompts[2]), 0, prompts[2])
    assert prefixes.stored_bytes <= prefixes.max_bytes
    assert prefixes.match(prompts[1]) == (None, 0)  # the least recently used went
    assert prefixes.match(prompts[0])[1] == len(prompts[0])


def test_a_batch_reuses_a_shared_system_prompt_and_outputs_are_unchanged(tiny_target) -> None:
    """Greedy output of requests that copy a stored prefix equals their output alone."""
    prompts = [tiny_target.encode_prompt(SYSTEM + text) for text in ("Hello", "The fox", "Hello")]
    expected = [reference_greedy(tiny_target, ids, 12) for ids in prompts]
    batch = Batch(tiny_target, BatchSettings(prefix_cache_bytes=1 << 20))
    collectors = [Collector() for _ in prompts]
    batch.add(start(tiny_target, None, prompts[0], max_new_tokens=12)[1], collectors[0])
    batch.iterate()  # the first prompt's pass: stored
    assert batch.stats.reused_tokens == 0
    for ids, collector in zip(prompts[1:], collectors[1:], strict=True):
        batch.add(start(tiny_target, None, ids, max_new_tokens=12)[1], collector)
    batch.run_until_idle()
    shared = next(i for i, (a, b) in enumerate(zip(prompts[0], prompts[1], strict=False)) if a != b)
    # The second copies the system prompt; the third, the same prompt as the first, all of it
    # but its last token (which its first round feeds).
    assert batch.stats.reused_tokens == shared + len(prompts[2]) - 1
    computed = sum(len(ids) - 1 for ids in prompts) - batch.stats.reused_tokens
    assert batch.stats.prefill_tokens == computed
    for want, collector in zip(expected, collectors, strict=True):
        assert collector.error is None and collector.tokens == want


def test_no_prefix_cache_when_disabled(tiny_target) -> None:
    prompt = tiny_target.encode_prompt(SYSTEM + "Hello")
    batch = Batch(tiny_target, BatchSettings(prefix_cache_bytes=0))
    for _ in range(2):
        batch.add(start(tiny_target, None, prompt, max_new_tokens=4)[1], Collector())
        batch.run_until_idle()
    assert batch.prefixes is None and batch.stats.reused_tokens == 0
    assert batch.stats.prefill_tokens == 2 * (len(prompt) - 1)


def test_a_request_queued_before_the_prompt_was_stored_still_reuses_it(tiny_target) -> None:
    prompts = [tiny_target.encode_prompt(SYSTEM + text) for text in ("Hello", "The fox")]
    batch = Batch(tiny_target, BatchSettings(max_rows=1, prefix_cache_bytes=1 << 20))
    collectors = [Collector() for _ in prompts]
    for ids, collector in zip(prompts, collectors, strict=True):  # both queued at once
        batch.add(start(tiny_target, None, ids, max_new_tokens=6)[1], collector)
    batch.run_until_idle()
    shared = next(i for i, (a, b) in enumerate(zip(*prompts, strict=False)) if a != b)
    assert batch.stats.reused_tokens == shared
    for ids, collector in zip(prompts, collectors, strict=True):
        assert collector.tokens == reference_greedy(tiny_target, ids, 6)


def test_a_next_turn_reuses_the_previous_prompt_and_answer(tiny_target) -> None:
    """A finished stream's prompt and answer are kept (replacing its prompt's entry); a next
    turn that re-sends them copies all of it but the answer's last token (never in the row)."""
    first = tiny_target.encode_prompt(SYSTEM + "Hello")
    batch = Batch(tiny_target, BatchSettings(prefix_cache_bytes=1 << 20))
    collector = Collector()
    batch.add(start(tiny_target, None, first, max_new_tokens=10, ignore_eos=True)[1], collector)
    batch.run_until_idle()
    answer = collector.tokens
    assert len(answer) == 10
    second = first + answer + tiny_target.encode_prompt(" and then?")[1:]
    replies = Collector()
    batch.add(start(tiny_target, None, second, max_new_tokens=8)[1], replies)
    batch.run_until_idle()
    assert batch.stats.reused_tokens == len(first) + len(answer) - 1
    assert replies.tokens == reference_greedy(tiny_target, second, 8)
    # One entry is left: each stored sequence began the next one, which replaced it.
    assert batch.prefixes is not None and len(batch.prefixes) == 1


@pytest.mark.parametrize(
    ("stored", "tokens", "shared"),
    [
        ((1, 2, 3), (1, 2, 3), 3),
        ((1, 2, 3), (1, 2, 4, 5), 2),
        ((1, 2), (1, 2, 3), 2),
        ((5, 2, 3), (1, 2, 3), 0),
        ((), (1,), 0),
        (tuple(range(999)), (*range(500), 7), 500),
    ],
)
def test_shared_length(stored, tokens, shared) -> None:
    assert _shared_length(stored, tokens) == shared
