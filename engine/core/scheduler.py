"""The scheduling policy: which requests run, what each step computes, and who gives way when memory runs out.

- Admission is first come, first served, by budget: a request starts when its prompt's blocks (less those found in
  the prefix cache) fit in the free pool with one block of growth room per running sequence, and the sequence cap
  (MAX_NUM_SEQS) allows.
- Each step decodes one token for every decoding sequence, then spends the rest of the token budget
  (MAX_NUM_BATCHED_TOKENS) on prompts, oldest first: every prompt that fits whole, and at most one chunk of a
  prompt that does not, only in a step where no older prompt finishes. A step's time is its tokens', so a
  finishing prompt's first token never waits for a later prompt's chunk (4 documents of 1049 tokens at once:
  first tokens after 1, 2, 3 and 4 documents' time rather than after 1.5, 2.5, 3.5 and 4).
- When a decoding sequence needs a new block and none is free, the youngest running request is preempted: its
  blocks are freed and it goes back to the front of the queue, to be recomputed later from its tokens (its
  sampling state is kept, so a seeded or greedy run continues exactly as it would have).
- A request that could not run even alone in the whole pool is refused at arrival (`check_fits`).
- A request for a LoRA adapter also needs one of the MAX_LORAS adapter slots (engine/lora/registry.py) from
  admission to its end; while every slot is held by running requests of other adapters it waits, as for blocks.
  Its prefix-cache keys start from its adapter's, so no two adapters (or an adapter and the base) share blocks.
- Models with recurrent layers (state_cache.py): each running sequence also holds a state slot (there are
  MAX_NUM_SEQS). Those whose layers cannot carry a state into a multi-token pass (`whole_prompts`) compute each
  prompt in one pass: the first prompt of a step goes whole even past the token budget, further ones only while
  they fit.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from engine.core.block_manager import BLOCK_SIZE, BlockManager, blocks_for, chain_key, prefix_root
from engine.core.sequence import Sequence, SequenceGroup, Status, enqueue
from engine.executor.state_cache import RecurrentStates


@dataclass
class PrefillWork:
    seq: Sequence
    length: int  # tokens of this chunk
    logits: str  # "none" | "last" | "all"


@dataclass
class StepPlan:
    decodes: list[Sequence] = field(default_factory=list)
    prefills: list[PrefillWork] = field(default_factory=list)
    # Decoding sequences that verify speculative tokens: their last token and `proposal` in one chunk.
    verifies: list[Sequence] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.decodes and not self.prefills and not self.verifies


class Scheduler:
    def __init__(self, blocks: BlockManager, *, max_num_seqs: int, max_num_batched_tokens: int,
                 states: RecurrentStates | None = None, whole_prompts: bool = False, lora=None):
        self.blocks = blocks
        self.lora = lora  # engine/lora/registry.py's LoraRegistry, or None (LoRA off)
        # Requests taken out of the queue because they cannot run (their adapter was unloaded), with why; the
        # loop fails them.
        self.refused: list[tuple[SequenceGroup, Exception]] = []
        self.states = states
        self.whole_prompts = whole_prompts
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[SequenceGroup] = deque()
        self.running: list[SequenceGroup] = []  # admission order: oldest first
        self.preemptions = 0

    # ---- requests coming and going ----

    def check_fits(self, prompt_len: int, max_tokens: int, num_sequences: int) -> str | None:
        """Why a request can never run, or None. Worst case: every choice holds its whole sequence alone."""
        need = num_sequences * blocks_for(prompt_len + max_tokens)
        if need > self.blocks.num_blocks:
            return (f"the request needs up to {need * BLOCK_SIZE} tokens of KV cache ({num_sequences} x "
                    f"({prompt_len} prompt + {max_tokens} max_tokens)), more than the whole cache holds "
                    f"({self.blocks.num_blocks * BLOCK_SIZE} tokens)")
        return None

    def add(self, group: SequenceGroup) -> None:
        enqueue(self.waiting, group)

    def remove(self, group: SequenceGroup) -> None:
        """A request leaves (finished, aborted or failed): out of the queue, its blocks freed."""
        try:
            self.waiting.remove(group)
        except ValueError:
            pass
        if group in self.running:
            self.running.remove(group)
        for seq in group.seqs:
            self.free(seq)
        self._release_adapter(group)

    def _release_adapter(self, group: SequenceGroup) -> None:
        if group.lora_slot:
            self.lora.release(group.lora_slot)
            group.lora_slot = 0

    def free(self, seq: Sequence) -> None:
        self.blocks.release(seq.blocks)
        seq.blocks = []
        seq.block_keys = []
        if seq.state_slot is not None:
            self.states.release(seq.state_slot)
            seq.state_slot = None

    @property
    def num_running_seqs(self) -> int:
        return sum(1 for g in self.running for s in g.seqs if not s.finished)

    # ---- one step ----

    def schedule(self) -> StepPlan:
        self._admit()
        plan = StepPlan()
        for group in list(self.running):
            if group not in self.running:  # preempted while making room for an older one
                continue
            rows = []
            for seq in group.seqs:
                if seq.status == Status.DECODING:
                    if not self._make_room(seq):
                        rows = []  # its own request gave way: none of its sequences runs this step
                        break
                    rows.append(seq)
            plan.decodes.extend(rows)
        budget = self.max_num_batched_tokens - len(plan.decodes)
        budget -= self._plan_verifies(plan, budget)
        prefilling = [(g, s) for g in self.running for s in g.seqs if s.status == Status.PREFILLING]
        finishing = partial = False
        for group, seq in prefilling:
            remaining = seq.prefill_target - seq.num_computed
            if self.whole_prompts:  # in arrival order
                if plan.prefills and remaining > budget:
                    break
                take = remaining
            elif budget <= 0:
                break
            elif remaining <= budget:
                take = remaining
            elif finishing or partial:
                # A chunk that does not finish its prompt would only make this step, and so the first tokens
                # of the prompts finishing in it, later; it goes first in a step of its own.
                continue
            else:
                # Even chunks, so the prompt's last step is not a sliver and the next prompt's chunk need not fill
                # it, each ending on a block boundary (1049 tokens over a 512 budget: 352, 352, 345): a block's keys
                # come from one step, and the prefill kernel's 16-token tiles are whole.
                share = -(-remaining // -(-remaining // budget))
                end = -(-(seq.num_computed + share) // BLOCK_SIZE) * BLOCK_SIZE
                take = min(budget, end - seq.num_computed)
                partial = True
            fresh = not group.started
            last = seq.num_computed + take == seq.prefill_target
            finishing = finishing or last
            wants_all = fresh and group.params.prompt_logprobs is not None
            plan.prefills.append(PrefillWork(seq, take, "all" if wants_all else
                                             "last" if (fresh and last) else "none"))
            budget -= take
        return plan

    def _plan_verifies(self, plan: StepPlan, budget: int) -> int:
        """Decoding sequences with a current proposal verify it instead of decoding one token, when the budget
        and free blocks allow (speculation never preempts anyone). Returns the extra tokens planned."""
        extra = 0
        for seq in list(plan.decodes):
            k = len(seq.proposal)
            if not k or seq.proposal_at != len(seq.tokens):
                continue
            need = blocks_for(len(seq.tokens) + k) - len(seq.blocks)
            if k > budget - extra or need > self.blocks.num_free:
                seq.proposal = []
                continue
            for _ in range(need):
                seq.blocks.append(self.blocks.allocate())
            plan.decodes.remove(seq)
            plan.verifies.append(seq)
            extra += k
        return extra

    def trim(self, seq: Sequence) -> None:
        """Let go of blocks past the sequence's next slot (reserved for speculative tokens it did not keep)."""
        keep = blocks_for(len(seq.tokens))
        if len(seq.blocks) > keep:
            self.blocks.release(seq.blocks[keep:])
            del seq.blocks[keep:]

    def _make_room(self, seq: Sequence) -> bool:
        """Ensure the slot for `seq`'s next token exists, preempting younger requests (or, if it is the youngest,
        its own) when the pool is full. False if `seq`'s own request was preempted."""
        position = len(seq.tokens) - 1
        while position // BLOCK_SIZE >= len(seq.blocks):
            if self.blocks.num_free == 0:
                victim = self._victim()
                self.preempt(victim)
                if victim is seq.group:
                    return False
                continue
            seq.blocks.append(self.blocks.allocate())
        return True

    def preempt(self, group: SequenceGroup) -> None:
        self.running.remove(group)
        for seq in group.seqs:
            if seq.finished:
                continue
            self.free(seq)
            seq.num_computed = 0
            seq.status = Status.WAITING
        if not group.started:
            group.prompt_logprobs = None  # collected again when the prompt is recomputed
        self._release_adapter(group)
        group.metrics.preemptions += 1
        self.preemptions += 1
        enqueue(self.waiting, group)

    def _victim(self) -> SequenceGroup:
        """The running request that gives way: the highest priority value, the latest admitted among equals."""
        return max(reversed(self.running), key=lambda g: g.params.priority)

    def _admit(self) -> None:
        while self.waiting:
            group = self.waiting[0]
            members = [s for s in group.seqs if not s.finished]
            if self.num_running_seqs + len(members) > self.max_num_seqs:
                return
            adapter = group.params.lora_name
            if adapter is not None and not group.lora_slot:
                try:
                    held = self.lora.acquire(adapter)
                except Exception as exc:  # unloaded while it waited
                    self.waiting.popleft()
                    self.refused.append((group, exc))
                    continue
                if held is None:
                    return  # every adapter slot is held by running requests: wait for one to finish
                group.lora_slot, group.lora_key = held
            if not self._allocate(group, members):
                self._release_adapter(group)
                return
            self.waiting.popleft()
            self.running.append(group)
            if group.metrics.admitted is None:
                group.metrics.admitted = time.perf_counter()

    def _allocate(self, group: SequenceGroup, members: list[Sequence]) -> bool:
        """Give an admitted request's sequences their blocks (prefix-cache hits first), all or nothing."""
        fresh = not group.started
        prefilling = members[:1] if fresh else members
        hits: list[list[tuple[int, int]]] = []
        need = 0
        for seq in prefilling:
            found = []
            if group.params.prompt_logprobs is None or not fresh:
                # leave at least one token to compute: its logits give the next token
                found = self.blocks.lookup(seq.cache_tokens, seq.prefill_target - (1 if fresh else 0),
                                           prefix_root(group.params.cache_salt, group.lora_key))
            hits.append(found)
            need += blocks_for(seq.prefill_target) - len(found)
        forks = len(members) - 1 if fresh else 0  # each further choice gets its own copy of the last block
        # Running requests keep a block of growth room each; alone in the pool it must fit (check_fits).
        headroom = self.num_running_seqs + len(members) if self.running else 0
        if need + forks + headroom > self.blocks.num_free:
            for found in hits:
                self.blocks.release([b for b, _ in found])
            return False
        for seq, found in zip(prefilling, hits):
            self.blocks.count_hits(found)
            seq.blocks = [b for b, _ in found]
            seq.block_keys = [k for _, k in found]
            seq.num_computed = len(found) * BLOCK_SIZE
            while len(seq.blocks) < blocks_for(seq.prefill_target):
                seq.blocks.append(self.blocks.allocate())
            seq.status = Status.PREFILLING if seq.num_computed < seq.prefill_target else Status.DECODING
        if fresh:
            group.metrics.cached_prompt_tokens = prefilling[0].num_computed
            for seq in members[1:]:
                seq.blocks = [self.blocks.allocate()]  # reserved for the fork
                seq.status = Status.FORK_PENDING
        if self.states is not None:
            for seq in members:
                seq.state_slot = self.states.allocate()
        return True

    def fork(self, group: SequenceGroup) -> tuple[list[tuple[int, int]], list[Sequence]]:
        """The prompt is computed: the further choices share its full blocks and take their own copy of its
        partly filled one. Returns the (source, destination) block copies the cache must make, and the choices
        that forked (each to take the prompt's recurrent state, for models that keep one)."""
        first = group.seqs[0]
        full = first.num_computed // BLOCK_SIZE
        copies = []
        forked = [seq for seq in group.seqs[1:] if seq.status == Status.FORK_PENDING]
        for seq in forked:
            own = seq.blocks[0]
            for block in first.blocks[:full]:
                self.blocks.hold(block)
            seq.blocks = first.blocks[:full] + [own]
            seq.block_keys = list(first.block_keys[:full])
            seq.num_computed = first.num_computed
            seq.status = Status.DECODING
            if first.num_computed % BLOCK_SIZE:
                copies.append((first.blocks[full], own))
        return copies, forked

    def computed(self, seq: Sequence, count: int) -> None:
        """`count` more of `seq`'s tokens are in the cache: full blocks become findable by their prefix."""
        seq.num_computed += count
        if not self.blocks.enabled:
            return
        previous = seq.block_keys[-1] if seq.block_keys else prefix_root(seq.group.params.cache_salt,
                                                                          seq.group.lora_key)
        keyed = seq.cache_tokens
        for index in range(len(seq.block_keys), seq.num_computed // BLOCK_SIZE):
            tokens = tuple(keyed[index * BLOCK_SIZE:(index + 1) * BLOCK_SIZE])
            previous = chain_key(previous, tokens)
            seq.block_keys.append(previous)
            self.blocks.register(seq.blocks[index], previous, tokens)
