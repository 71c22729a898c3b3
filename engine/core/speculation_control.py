"""When speculation pays: the step-level switch (by load) and the per-sequence draft length (by acceptance).

Verifying K guesses costs K more rows in the step. At one stream a decode step is bound by reading the weights,
so extra rows are nearly free and every kept guess is a token gained; once the batch fills the machine, rows cost
compute and guesses that are thrown away cost as much as kept ones, so speculating at every step can be much
slower than plain decoding there. Neither the crossover nor the cost of a draft model is known in advance, so
both are measured:

- `LoadSwitch`: for each number of decoding sequences (up to the next power of two), the time per generated token of steps that speculated and
  of steps that did not (moving averages over decode-only steps, drafting included). The faster one runs; the
  slower one is tried again now and then, less often each time it loses again, so a wrong choice costs at most a
  few steps in a hundred. A batch size never seen borrows the verdict of the nearest smaller one it has (the gain
  only shrinks as the batch grows), so a new load level does not pay for a fresh trial first.
- `DraftLength`: each sequence's chance that a guess is kept (the share of guessed positions kept, from its own
  history); it guesses only as far ahead as a guess is still likely to be kept, and a sequence whose guesses are
  mostly rejected stops guessing except for a rare probe.
"""
from __future__ import annotations

import math

_SMOOTHING = 0.25  # weight of a new step time in its moving average
_FIRST_TRIALS = 1  # steps of each mode before a batch size has a verdict (later steps refine it)
_RETRY_FIRST, _RETRY_MAX = 16, 512  # steps between trials of the slower mode: doubles while it keeps losing
_BORROWED_RETRY = 64  # steps before the first trial of speculation at a size whose smaller neighbour lost
_MARGIN = 0.95  # speculation must cost less than this share of plain's time per token to be chosen
_TRIAL_BUDGET = 50  # a loser slower by a factor r is retried at most every 50 (r - 1) steps: its trials cost <= 2%
_MAX_BATCH_KEY = 64  # larger batches share one entry


def _key(batch: int) -> int:
    """The entry a batch size's measurements go to: sizes up to the next power of two share one (5 to 8, 17 to
    32...), so a batch that shrinks as its streams finish keeps its verdict instead of paying for new trials."""
    return min(1 << (batch - 1).bit_length(), _MAX_BATCH_KEY)
_CLEAR_WIN = 0.9  # a trial this much faster than the verdict's average is retried at once


class _Averages:
    __slots__ = ("time_per_token", "samples")

    def __init__(self):
        self.time_per_token = 0.0
        self.samples = 0

    def add(self, seconds_per_token: float) -> None:
        # The plain mean of the first few samples (one odd first step weighs 1/n, not 3/4 of the next), then a
        # moving average that follows the machine.
        self.samples += 1
        weight = max(1 / self.samples, _SMOOTHING)
        self.time_per_token = (1 - weight) * self.time_per_token + weight * seconds_per_token


class _BatchSize:
    __slots__ = ("modes", "since_retry", "retry_every", "winner")

    def __init__(self):
        self.modes = {True: _Averages(), False: _Averages()}
        self.since_retry = 0
        self.retry_every = _RETRY_FIRST
        self.winner: bool | None = None

    def verdict(self) -> bool | None:
        """True: speculating is faster here, by a margin; None: not measured enough yet. Near a tie plain wins:
        step times wobble by a few percent, and a verdict that flips with them spends steps speculating where it
        loses."""
        spec, plain = self.modes[True], self.modes[False]
        if spec.samples < _FIRST_TRIALS or plain.samples < _FIRST_TRIALS:
            return None
        return spec.time_per_token < _MARGIN * plain.time_per_token


class LoadSwitch:
    """Whether this step speculates, from measured time per token at this batch size."""

    def __init__(self, disable_by_batch_size: int | None = None, adaptive: bool = True):
        self.disable_by_batch_size = disable_by_batch_size
        self.adaptive = adaptive
        self._sizes: dict[int, _BatchSize] = {}
        self.switched_off_steps = 0

    def choose(self, batch: int) -> bool:
        if self.disable_by_batch_size is not None and batch >= self.disable_by_batch_size:
            self.switched_off_steps += 1
            return False
        if not self.adaptive or batch == 0:
            return True
        size = self._sizes.setdefault(_key(batch), _BatchSize())
        verdict = size.verdict()
        if verdict is None:
            borrowed = self._borrowed(_key(batch))
            spec, plain = size.modes[True].samples, size.modes[False].samples
            if borrowed is False and plain >= spec:
                # A smaller batch already lost with speculation: this one will too. Keep measuring plain steps
                # and try speculation only after a while: at a large batch a speculating trial costs more a token
                # than a plain step, for nothing.
                if not spec:
                    size.retry_every = max(size.retry_every, _BORROWED_RETRY)
                choice = self._retry_due(size, loser=True)
            else:
                choice = spec <= plain  # alternate until both have their first trials
        else:
            if verdict != size.winner:
                if size.winner is not None:  # the verdict turned: the new loser is retried soon
                    size.retry_every, size.since_retry = _RETRY_FIRST, 0
                size.winner = verdict
            choice = self._retry_due(size, loser=not verdict)
        if not choice:
            self.switched_off_steps += 1
        return choice

    @staticmethod
    def _retry_due(size: _BatchSize, loser: bool) -> bool:
        """The winning mode, except for one step of `loser` every `retry_every` steps; the interval doubles (or,
        where the loser loses by more than a quarter, quadruples) each time the trial confirms the verdict."""
        size.since_retry += 1
        spec, plain = size.modes[True].time_per_token, size.modes[False].time_per_token
        ratio = max(spec, plain) / min(spec, plain) if min(spec, plain) > 0 else 1.0
        # A trial costs what the loser loses on it: a slow draft model can take several plain steps' time a token,
        # so trials at the usual spacing would cost a good share of the time.
        if size.since_retry >= max(size.retry_every, min(int(_TRIAL_BUDGET * (ratio - 1)), _RETRY_MAX)):
            size.since_retry = 0
            # A trial of a mode that loses by much costs much: space those out faster.
            size.retry_every = min(size.retry_every * (4 if ratio > 1.25 else 2), _RETRY_MAX)
            return loser
        return not loser

    def _borrowed(self, batch: int) -> bool | None:
        """The nearest smaller measured batch size's verdict, taken as a loss unless speculation won there clearly
        (the gain only shrinks as the batch grows, so a narrow win does not carry over)."""
        for smaller in range(batch - 1, 0, -1):
            size = self._sizes.get(smaller)
            if size is not None and size.verdict() is not None:
                spec, plain = size.modes[True].time_per_token, size.modes[False].time_per_token
                return spec < _CLEAR_WIN * plain
        return None

    def record(self, batch: int, speculated: bool, seconds: float, tokens: int) -> None:
        """One decode-only step's wall time (drafting included) and the tokens it generated."""
        if not self.adaptive or tokens <= 0 or batch == 0:
            return
        size = self._sizes.setdefault(_key(batch), _BatchSize())
        size.modes[speculated].add(seconds / tokens)
        winner = size.modes[not speculated]
        if speculated != size.winner and size.winner is not None and \
                seconds / tokens < _CLEAR_WIN * winner.time_per_token:
            # The trial beat the verdict clearly (not by a step's noise): the machine or the text changed. Try
            # again at once, until the averages agree on a verdict again.
            size.since_retry, size.retry_every = _RETRY_FIRST, _RETRY_FIRST


_KEEP_CHANCE_NEEDED = 0.2  # a guess is worth its row while the chance it is kept stays above this
_PROBE_EVERY = 8  # steps between single-guess probes of a sequence that stopped guessing
_HISTORY = 0.9  # weight of a sequence's past verifications against its newest


class DraftLength:
    """Per sequence (by id): the chance a guess at the next position is kept, as kept / (kept + rejections) over
    its verifications, so the k-th guess is kept with chance p**k; it guesses while that is above 0.2."""

    def __init__(self):
        self._seqs: dict[int, list[float]] = {}  # id -> [kept, rejections, steps since it last guessed]

    def length(self, key: int, k: int) -> int:
        kept, rejected, idle = self._seqs.setdefault(key, [1.0, 1.0, 0.0])  # prior: even odds
        p = kept / (kept + rejected)
        if p >= 1.0:
            return k
        ahead = math.floor(math.log(_KEEP_CHANCE_NEEDED) / math.log(p)) if p > 0 else 0
        if ahead >= 1:
            return min(k, ahead)
        self._seqs[key][2] = idle + 1
        if idle + 1 >= _PROBE_EVERY:
            self._seqs[key][2] = 0
            return 1
        return 0

    def verified(self, key: int, proposed: int, kept: int) -> None:
        state = self._seqs.setdefault(key, [1.0, 1.0, 0.0])
        state[0] = _HISTORY * state[0] + kept
        state[1] = _HISTORY * state[1] + (1 if kept < proposed else 0)

    def forget_except(self, live: set[int]) -> None:
        for key in [k for k in self._seqs if k not in live]:
            del self._seqs[key]
