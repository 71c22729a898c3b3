"""The scheduler and the block manager on their own: real sequences over a small pool, no model."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer

from engine.core.block_manager import BLOCK_SIZE, BlockManager, chain_key
from engine.config import EngineConfig
from engine.loader import model_folder
from engine.sampling.sampler import SamplingParams
from engine.core.scheduler import Scheduler
from engine.core.sequence import Sequence, SequenceGroup, Status
from engine.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    hf = AutoTokenizer.from_pretrained(model_folder(EngineConfig()))
    return Tokenizer(hf, None, frozenset({hf.eos_token_id}), len(hf))


class _Sink:
    def deliver(self, output) -> None:
        pass


def group(tokenizer, request_id: str, prompt: list[int]) -> SequenceGroup:
    g = SequenceGroup(request_id, prompt, SamplingParams(max_tokens=4, temperature=0.0), _Sink())
    g.seqs = [Sequence(g, 0, tokenizer, tokenizer.vocab_size, torch.device("cpu"))]
    return g


def cache_prefix(blocks: BlockManager, tokens: list[int]) -> None:
    """Leave `tokens` (whole blocks) in the prefix cache, as a finished request does."""
    key, held = 0, []
    for start in range(0, len(tokens), BLOCK_SIZE):
        part = tuple(tokens[start:start + BLOCK_SIZE])
        key = chain_key(key, part)
        block = blocks.allocate()
        blocks.register(block, key, part)
        held.append(block)
    blocks.release(held)


def test_prefix_cache_hits_count_once_when_the_request_is_admitted(tokenizer):
    """A request that finds its prefix cached but cannot be admitted yet (the pool is full) retries every step;
    its hits counted each time made prefix_cache_hit_tokens grow with the wait, not with the tokens reused."""
    blocks = BlockManager(num_blocks=8, max_cached_blocks=8)
    scheduler = Scheduler(blocks, max_num_seqs=4, max_num_batched_tokens=512)
    prefix = list(range(100, 100 + 2 * BLOCK_SIZE))
    cache_prefix(blocks, prefix)
    crowd = group(tokenizer, "crowd", list(range(1000, 1000 + 5 * BLOCK_SIZE - 4)))  # 5 of the 8 blocks
    scheduler.add(crowd)
    scheduler.schedule()
    assert crowd in scheduler.running
    waiter = group(tokenizer, "waiter", prefix + list(range(500, 500 + 2 * BLOCK_SIZE)))  # 2 cached + 2 new
    scheduler.add(waiter)
    for _ in range(5):
        scheduler.schedule()
        assert waiter not in scheduler.running
    assert blocks.hit_tokens == 0, "hits counted for a request that was not admitted"
    scheduler.remove(crowd)
    scheduler.schedule()
    assert waiter in scheduler.running and waiter.seqs[0].num_computed == 2 * BLOCK_SIZE
    assert blocks.hit_tokens == 2 * BLOCK_SIZE


def test_the_prefix_cache_evicts_the_block_released_longest_ago(tokenizer):
    """Cached blocks leave in the order their last holder let go: a prefix reused later outlives one that was
    not."""
    blocks = BlockManager(num_blocks=3, max_cached_blocks=2)
    first, second = list(range(10, 10 + BLOCK_SIZE)), list(range(40, 40 + BLOCK_SIZE))
    cache_prefix(blocks, first)
    cache_prefix(blocks, second)
    found = blocks.lookup(first, BLOCK_SIZE)  # reused, then released again: now the most recent
    blocks.release([block for block, _ in found])
    cache_prefix(blocks, list(range(70, 70 + BLOCK_SIZE)))  # a third cached block pushes the oldest out
    assert len(blocks.lookup(first, BLOCK_SIZE)) == 1
    assert blocks.lookup(second, BLOCK_SIZE) == []


def run_prefills(scheduler: Scheduler) -> list[list[tuple[str, int]]]:
    """Plan steps until no prompt is left to compute, marking each planned chunk computed as the loop does;
    returns each step's (request, tokens) chunks."""
    steps = []
    while True:
        plan = scheduler.schedule()
        if not plan.prefills:
            return steps
        steps.append([(work.seq.group.request_id, work.length) for work in plan.prefills])
        for work in plan.prefills:
            scheduler.computed(work.seq, work.length)
            if work.seq.num_computed == work.seq.prefill_target:
                work.seq.status = Status.DECODING


def test_a_finishing_prompt_does_not_wait_for_a_later_prompts_chunk(tokenizer):
    """Two long documents at once over a 512-token budget: the step that finishes the first computes nothing of
    the second, whose chunk made the first one's first token wait (1049 tokens: 512, then 537 shared 25 / 487),
    and chunks are even (to block boundaries), so no step is a sliver."""
    scheduler = Scheduler(BlockManager(num_blocks=200, max_cached_blocks=0), max_num_seqs=4,
                          max_num_batched_tokens=512)
    scheduler.add(group(tokenizer, "first", list(range(1000, 2049))))
    scheduler.add(group(tokenizer, "second", list(range(3000, 4049))))
    steps = run_prefills(scheduler)
    assert steps[:3] == [[("first", 352)], [("first", 352)], [("first", 345)]], steps
    assert all(("first", n) not in step for step in steps[3:] for n in range(1050)), steps
    # the second starts in the step after the first finishes (one decode row then shares the budget)
    assert sum(n for step in steps[3:] for _, n in step) == 1049 and len(steps) == 6, steps


def test_short_prompts_share_a_long_prompts_step_whole(tokenizer):
    """A short prompt behind a long one joins the long prompt's chunk whole (its first token after one step), and
    a long prompt behind a finishing one waits for the next step rather than fill it with a chunk."""
    scheduler = Scheduler(BlockManager(num_blocks=200, max_cached_blocks=0), max_num_seqs=4,
                          max_num_batched_tokens=512)
    scheduler.add(group(tokenizer, "long", list(range(1000, 1700))))
    scheduler.add(group(tokenizer, "short", list(range(2000, 2040))))
    scheduler.add(group(tokenizer, "later", list(range(3000, 3600))))
    steps = run_prefills(scheduler)
    assert steps[0] == [("long", 352), ("short", 40)], steps
    assert steps[1] == [("long", 348)], steps
    assert [name for step in steps[2:] for name, _ in step] == ["later", "later"], steps
