"""Beam search over the batching engine's sequences.

A beam-search request is a group of `width` sequences (its beams). They run in the engine's ordinary decode
steps, next to other requests; once every live beam of a group has its next-token logits, `BeamSearch.step`
scores the continuations and reassigns the group's sequences to the best ones. A sequence that continues
another beam takes that beam's tokens, text and block table: full blocks are shared (reference counts), and a
partly filled block that two beams would write to is copied (copy on write), so beams never copy the prompt.

Scoring follows transformers' `generate(num_beams=..., length_penalty=..., early_stopping=...)`: per step, the
top max(2, 1 + stop tokens) x beams continuations by accumulated logprob; those that stop (a stop token, a stop
string, max_tokens) become finished hypotheses scored sum(logprobs) / generated ** length_penalty (only if among
the first `beams` candidates), the best non-stopping ones run on. The search ends by transformers' rule for
`early_stopping` (True: `beams` finished; False: a heuristic on the current length; "never": only when no
running beam can still do better). Diverse (group) beam search splits the beams in `num_beam_groups` groups
searched one after the other at each step, each group's scores lowered by `diversity_penalty` times the
number of earlier groups' beams that chose the same token at this step (Hamming diversity, Vijayakumar et al.).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from engine.core.block_manager import BLOCK_SIZE, BlockManager
from engine.sampling.sampler import SamplingParams, TokenLogprob, bad_word_ends
from engine.core.sequence import RequestOutput, Sequence, SequenceDelta, SequenceGroup, Status

_NEG = -1.0e9  # transformers' "excluded" score


@dataclass
class _Hypothesis:
    """A finished beam."""
    score: float
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprob]
    finish_reason: str
    stop_reason: str | int | None


@dataclass
class _BeamGroupState:
    """One group of diverse beam search (the whole search when there is one group)."""
    scores: list[float]  # accumulated processed logprob per running beam, best first after each step
    finished: list[_Hypothesis] = field(default_factory=list)  # best first, at most `beams`
    improvable: bool = True  # transformers' "early stop heuristic unsatisfied"
    done: bool = False


@dataclass
class BeamState:
    groups: list[_BeamGroupState]
    pending: dict[int, torch.Tensor] = field(default_factory=dict)  # beam index -> its next-token logits
    generated: int = 0  # tokens every running beam has generated


@dataclass
class _Snapshot:
    """What a sequence carries as a beam, taken before the beams are reassigned."""
    tokens: list[int]
    num_computed: int
    blocks: list[int]
    block_keys: list[int]
    detok: object
    text: str
    logprobs: list[TokenLogprob]
    cumulative: float


class BeamSearch:
    def __init__(self, blocks: BlockManager, copy_block: Callable[[int, int], None],
                 free: Callable[[Sequence], None], copy_states: Callable[[list[int], list[int]], None] | None,
                 eos_token_ids: frozenset[int], vocab_size: int, max_model_len: int):
        self.blocks = blocks
        self.copy_block = copy_block
        self.free = free  # a sequence lets go of its blocks (and recurrent-state slot)
        self.copy_states = copy_states  # models with recurrent layers: slot contents follow the beams
        self.eos_token_ids = eos_token_ids
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len

    def step(self, group: SequenceGroup, seqs: list[Sequence], logits: torch.Tensor) -> RequestOutput | None:
        """Take next-token logits of some of the group's beams; once all running beams have theirs, advance the
        search one token. Returns the request's final output when the search is over."""
        params = group.params
        if group.beam is None:
            per_group = params.num_sequences // params.num_beam_groups
            group.beam = BeamState([_BeamGroupState([0.0] + [_NEG] * (per_group - 1))
                                    for _ in range(params.num_beam_groups)])
        state: BeamState = group.beam
        for seq, row in zip(seqs, logits):
            state.pending[seq.index] = row
        running = [s for s in group.seqs if not s.finished]
        if any(s.index not in state.pending for s in running):
            for seq in seqs:  # decoded ahead of a sibling still being recomputed: wait for it
                seq.status = Status.BEAM_PARKED
            return None
        rows = torch.stack([state.pending[s.index] for s in group.seqs if not s.finished])
        state.pending.clear()
        self._advance(group, state, running, rows)
        if all(g.done for g in state.groups):
            return self._final_output(group, state)
        return None

    # ---- one step of the search ----

    def _stop_tokens(self, params: SamplingParams) -> set[int]:
        return set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.eos_token_ids))

    def _processed_logprobs(self, params: SamplingParams, running: list[Sequence], logits: torch.Tensor,
                            generated: int) -> torch.Tensor:
        """Logprobs the search ranks by: log-softmax (of logits / temperature), then the request's logit
        treatments on the logprobs, as transformers' beam search applies its processors."""
        logits = logits[:, :self.vocab_size].float()
        if params.temperature > 0 and params.temperature != 1.0:
            logits = logits / params.temperature
        logp = torch.log_softmax(logits, dim=-1)
        if params.logit_bias:
            ids = torch.tensor([t for t in params.logit_bias if t < self.vocab_size], dtype=torch.long)
            values = torch.tensor([params.logit_bias[int(t)] for t in ids], dtype=logp.dtype)
            logp[:, ids.to(logp.device)] += values.to(logp.device)
        if generated < params.min_tokens:
            blocked = [t for t in self._stop_tokens(params) if t < self.vocab_size]
            if blocked:
                logp[:, torch.tensor(blocked, device=logp.device)] = float("-inf")
        banned = running[0].sampling.banned  # outside allowed_token_ids (built once, with the sequence)
        if banned is not None:
            logp.masked_fill_(banned, float("-inf"))
        prompt_len = len(running[0].group.prompt_ids)
        for i, seq in enumerate(running):
            out = seq.tokens[prompt_len:]
            ends = bad_word_ends(seq.sampling.bad_words, out)
            if ends:
                logp[i, torch.tensor(ends, device=logp.device)] = float("-inf")
            if params.repetition_penalty != 1.0:
                seen = torch.tensor(sorted(set(seq.tokens)), dtype=torch.long, device=logp.device)
                seen = seen[seen < self.vocab_size]
                picked = logp[i, seen]
                logp[i, seen] = torch.where(picked < 0, picked * params.repetition_penalty,
                                            picked / params.repetition_penalty)
            if out and (params.presence_penalty or params.frequency_penalty):
                counts = torch.bincount(torch.tensor(out, device=logp.device), minlength=logp.shape[1]).float()
                logp[i] -= params.frequency_penalty * counts[:logp.shape[1]] + \
                    params.presence_penalty * (counts[:logp.shape[1]] > 0).float()
        return logp

    def _advance(self, group: SequenceGroup, state: BeamState, running: list[Sequence],
                 logits: torch.Tensor) -> None:
        params = group.params
        generated = state.generated
        raw = torch.log_softmax(logits[:, :self.vocab_size].float(), dim=-1)  # reported logprobs, as vLLM's
        processed = self._processed_logprobs(params, running, logits, generated)
        stop_tokens = self._stop_tokens(params)
        per_group = params.num_sequences // params.num_beam_groups
        keep = max(2, 1 + len(stop_tokens)) * per_group
        snapshots = [self._snapshot(s) for s in running]
        live_groups = [g for g in state.groups if not g.done]
        # Beams of groups still searching, in order; a finished group's sequences were let go.
        offset = 0
        chosen_tokens: list[int] = []  # tokens the earlier groups' running beams took this step
        assignments: list[tuple[Sequence, int, int, float]] = []  # (sequence, parent row, token, raw logprob)
        top_k = params.logprobs or 0
        if top_k:
            top_vals, top_ids = raw.topk(top_k, dim=-1)
            top_vals, top_ids = top_vals.tolist(), top_ids.tolist()
        for beam_group in live_groups:
            members = list(range(offset, offset + per_group))
            offset += per_group
            scores = processed[members]
            if params.diversity_penalty and chosen_tokens:
                frequency = torch.bincount(torch.tensor(chosen_tokens, device=scores.device),
                                           minlength=scores.shape[1])[:scores.shape[1]].float()
                scores = scores - params.diversity_penalty * frequency
            total = scores + torch.tensor(beam_group.scores, device=scores.device).view(-1, 1)
            top_scores, top_index = total.view(-1).topk(keep)
            vocab = scores.shape[1]
            candidates = []
            for score, index in zip(top_scores.tolist(), top_index.tolist()):
                local, token = divmod(index, vocab)
                row = members[local]
                candidates.append((score, row, token, self._continue(snapshots[row], token, params, generated,
                                                                     stop_tokens, running[row].stops)))
            # The best `per_group` that do not stop run on (stopping ones only fill in, excluded by score).
            order = sorted(range(len(candidates)),
                           key=lambda i: candidates[i][0] + (_NEG if candidates[i][3][0] is not None else 0.0),
                           reverse=True)[:per_group]
            new_scores = []
            for slot, i in enumerate(order):
                score, row, token, _ = candidates[i]
                seq = running[members[slot]]
                assignments.append((seq, row, token, float(raw[row, token])))
                new_scores.append(score + (_NEG if candidates[i][3][0] is not None else 0.0))
                chosen_tokens.append(token)
            # Candidates among the first `per_group` that stop become finished hypotheses.
            full = len(beam_group.finished) >= per_group
            if beam_group.improvable and not (full and params.early_stopping is True):
                for i, (score, row, token, (reason, stop_reason, text)) in enumerate(candidates[:per_group]):
                    if reason is None:
                        continue
                    snap = snapshots[row]
                    lp = TokenLogprob(token, float(raw[row, token]),
                                      list(zip(top_ids[row], top_vals[row])) if top_k else [])
                    beam_group.finished.append(_Hypothesis(
                        score / ((generated + 1) ** params.length_penalty),
                        snap.tokens[len(group.prompt_ids):] + [token], text, snap.logprobs + [lp], reason,
                        stop_reason))
                beam_group.finished.sort(key=lambda h: h.score, reverse=True)
                del beam_group.finished[per_group:]
            beam_group.scores = new_scores
            # Can a running beam still beat the worst finished one?
            if params.early_stopping == "never" and params.length_penalty > 0:
                best_length = params.max_tokens
            else:
                best_length = generated + 1
            best_running = new_scores[0] / (best_length ** params.length_penalty)
            full = len(beam_group.finished) >= per_group
            worst = beam_group.finished[-1].score if full else _NEG
            beam_group.improvable = beam_group.improvable and best_running > worst
            beam_group.done = not (beam_group.improvable and not (full and params.early_stopping is True)
                                   and not all(c[3][0] is not None for c in candidates))
        state.generated = generated + 1
        self._reassign(group, running, snapshots, assignments, top_k and (top_ids, top_vals))
        for beam_group, start in zip(live_groups, range(0, len(running), per_group)):
            if beam_group.done:  # its beams are no longer needed
                for seq in running[start:start + per_group]:
                    self.free(seq)
                    seq.status = Status.FINISHED

    def _continue(self, snap: _Snapshot, token: int, params: SamplingParams, generated: int,
                  stop_tokens: set[int], stops) -> tuple[str | None, str | int | None, str]:
        """(finish reason or None, stop reason, text) of a beam extended by `token`."""
        count = generated + 1
        if token in stop_tokens and count > params.min_tokens:
            is_eos = token in self.eos_token_ids and not params.ignore_eos
            text = snap.text
            detok = snap.detok.clone()
            if params.include_stop_str_in_output:
                text += detok.push(token)
            return "stop", None if is_eos else token, text + detok.flush()
        detok = snap.detok.clone()
        delta = detok.push(token)
        text = snap.text + delta
        if delta and stops.stops and count > params.min_tokens:
            found = stops.find(text, len(delta))
            if found is not None:
                return "stop", found[0], text[:found[1]]
        if count >= params.max_tokens or len(snap.tokens) + 1 >= self.max_model_len:
            return "length", None, text + detok.flush()
        return None, None, text

    @staticmethod
    def _snapshot(seq: Sequence) -> _Snapshot:
        return _Snapshot(list(seq.tokens), seq.num_computed, list(seq.blocks), list(seq.block_keys), seq.detok,
                         seq.text, list(seq.new_logprobs), seq.cumulative_logprob)

    def _reassign(self, group: SequenceGroup, running: list[Sequence], snapshots: list[_Snapshot],
                  assignments: list[tuple[Sequence, int, int, float]], top) -> None:
        """Each running sequence becomes the continuation of its assigned parent beam. Blocks are held for the
        new owners before the old ones let go, then a partly filled block shared by two beams is copied."""
        for seq, row, token, logprob in assignments:
            snap = snapshots[row]
            for block in snap.blocks:
                self.blocks.hold(block)
            seq.tokens = snap.tokens + [token]
            seq.num_computed = snap.num_computed
            seq.blocks = list(snap.blocks)
            seq.block_keys = list(snap.block_keys)
            seq.detok = snap.detok.clone()
            seq.text = snap.text + seq.detok.push(token)
            entry = TokenLogprob(token, logprob, list(zip(top[0][row], top[1][row])) if top else [])
            seq.new_logprobs = snap.logprobs + [entry]
            seq.cumulative_logprob = snap.cumulative + logprob
            seq.status = Status.DECODING
        for snap in snapshots:
            self.blocks.release(snap.blocks)
        if self.copy_states is not None:
            self.copy_states([running[row].state_slot for _, row, _, _ in assignments],
                             [seq.state_slot for seq, _, _, _ in assignments])
        for seq, _, _, _ in assignments:
            if seq.num_computed % BLOCK_SIZE == 0:
                continue  # the next token starts a new block
            index = seq.num_computed // BLOCK_SIZE
            shared = seq.blocks[index]
            if self.blocks.refs(shared) > 1:
                own = self.blocks.allocate()
                self.copy_block(shared, own)
                self.blocks.release([shared])
                seq.blocks[index] = own

    def _final_output(self, group: SequenceGroup, state: BeamState) -> RequestOutput:
        params = group.params
        ranked = sorted((h for g in state.groups for h in g.finished), key=lambda h: h.score, reverse=True)
        ranked = ranked[:params.n]
        deltas = [SequenceDelta(i, h.text, h.token_ids, h.logprobs if params.logprobs is not None else None,
                                h.finish_reason, h.stop_reason) for i, h in enumerate(ranked)]
        metrics = group.metrics
        metrics.finished = time.perf_counter()
        metrics.output_tokens = sum(len(h.token_ids) for h in ranked)
        output = RequestOutput(group.request_id, deltas, finished=True, metrics=metrics)
        if group.prompt_logprobs is not None and not group.prompt_logprobs_sent:
            output.prompt_logprobs = group.prompt_logprobs
            group.prompt_logprobs_sent = True
        return output
