"""Per-token output work: appending a sampled token, detokenising, stop checks, and turning what sequences
produced into deltas for their requests (ranking `best_of` candidates when all of them are done)."""
from __future__ import annotations

import time

from engine.sampling.sampler import TokenLogprob
from engine.core.sequence import RequestOutput, Sequence, SequenceDelta, SequenceGroup, Status


class OutputProcessor:
    def __init__(self, eos_token_ids: frozenset[int], max_model_len: int):
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self._dirty: dict[SequenceGroup, None] = {}  # groups with outputs to deliver, in order

    def append(self, seq: Sequence, token: int, logprob: TokenLogprob | None) -> bool:
        """Add a sampled token to a sequence; True when this token finished it."""
        params = seq.group.params
        seq.tokens.append(token)
        seq.new_ids.append(token)
        if logprob is not None:
            seq.cumulative_logprob += logprob.logprob
            if params.logprobs is not None:
                seq.new_logprobs.append(logprob)
        self._dirty[seq.group] = None
        generated = seq.num_generated
        is_eos = token in self.eos_token_ids and not params.ignore_eos
        # The first min_tokens tokens cannot end the sequence. EOS is checked before stop_token_ids (vLLM's order:
        # an EOS listed in stop_token_ids still reports stop_reason None).
        if generated > params.min_tokens and (is_eos or token in params.stop_token_ids):
            if params.include_stop_str_in_output:  # as vLLM: the stop token's text stays (empty if special+skipped)
                seq.text += seq.detok.push(token)
            return self._finish(seq, "stop", None if is_eos else token)
        delta = seq.detok.push(token)
        if delta:
            seq.text += delta
            if seq.stops.stops and generated > params.min_tokens:
                found = seq.stops.find(seq.text, len(delta))
                if found is not None:
                    stop, cut = found
                    seq.text = seq.text[:cut]
                    return self._finish(seq, "stop", stop)
        matcher = seq.sampling.matcher
        if matcher is not None and matcher.is_terminated():  # the structured output is complete
            return self._finish(seq, "stop", None)
        if generated >= params.max_tokens or len(seq.tokens) >= self.max_model_len:
            return self._finish(seq, "length", None)
        return False

    def _finish(self, seq: Sequence, reason: str, stop_reason: str | int | None) -> bool:
        if not isinstance(stop_reason, str):  # a stop string cut the text; otherwise release held-back bytes
            seq.text += seq.detok.flush()
        seq.finish_reason = reason
        seq.stop_reason = stop_reason
        seq.status = Status.FINISHED
        group = seq.group
        if group.all_finished:
            group.metrics.finished = time.perf_counter()
            group.metrics.output_tokens = sum(s.num_generated for s in group.seqs)
        return True

    def take_outputs(self) -> list[tuple[SequenceGroup, RequestOutput]]:
        """What each group with news has to deliver now (groups whose outputs are held back are skipped)."""
        dirty, self._dirty = self._dirty, {}
        outputs = []
        for group in dirty:
            if group.done:
                continue
            finished = group.all_finished
            if group.holds_output and not finished:
                continue
            if group.holds_output:
                ranked = sorted(group.seqs, key=lambda s: s.cumulative_logprob, reverse=True)[:group.params.n]
                deltas = [self._take_delta(s, index) for index, s in enumerate(ranked)]
            else:
                deltas = [d for s in group.seqs if (d := self._take_delta(s, s.index)) is not None]
            output = RequestOutput(group.request_id, deltas, finished=finished,
                                   metrics=group.metrics if finished else None)
            if group.prompt_logprobs is not None and not group.prompt_logprobs_sent and \
                    len(group.prompt_logprobs) == len(group.prompt_ids):
                output.prompt_logprobs = group.prompt_logprobs
                group.prompt_logprobs_sent = True
            outputs.append((group, output))
        return outputs

    @staticmethod
    def _take_delta(seq: Sequence, index: int) -> SequenceDelta | None:
        finished = seq.finished
        upto = len(seq.text) if finished else seq.stops.releasable(seq.text)
        text = seq.text[seq.sent_chars:upto] if upto > seq.sent_chars else ""
        if not text and not seq.new_ids and not finished:
            return None
        seq.sent_chars = max(seq.sent_chars, upto)
        logprobs = seq.new_logprobs if seq.group.params.logprobs is not None else None
        delta = SequenceDelta(index, text, seq.new_ids, logprobs,
                              seq.finish_reason if finished else None, seq.stop_reason if finished else None)
        seq.new_ids, seq.new_logprobs = [], []
        return delta
