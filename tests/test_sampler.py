"""The sampler's random draws: one token per row from the row's probabilities, checked by counting."""
import math

import pytest
import torch

from engine.cpu import native_kernels
from engine.sampling.sampler import Sampler, SamplingParams, SequenceSamplingState, draw


@pytest.fixture(scope="module")
def kernels():
    assert native_kernels.load(), native_kernels.reason()  # scripts/install.sh builds them
    return native_kernels.active()


def _chi_square_ok(counts: torch.Tensor, expected: torch.Tensor) -> tuple[bool, float, int]:
    """Pearson's statistic over the tokens expected at least 20 times (the rest pooled into one bin), against
    its degrees of freedom plus 4.5 standard deviations."""
    big = expected >= 20
    observed = torch.cat([counts[big], counts[~big].sum().view(1)])
    wanted = torch.cat([expected[big], expected[~big].sum().view(1)])
    keep = wanted > 0
    chi2 = float(((observed[keep] - wanted[keep]) ** 2 / wanted[keep]).sum())
    df = int(keep.sum()) - 1
    return chi2 < df + 4.5 * math.sqrt(2 * df), chi2, df


def test_draws_follow_the_probabilities_and_never_take_an_impossible_token():
    torch.manual_seed(0)
    vocab = 2500  # three chunks of 1024, the last one padded
    probs = torch.rand(vocab) ** 6
    probs[::3] = 0.0  # impossible tokens in every chunk
    probs[2047] = 0.0  # the last token of a chunk
    probs[2049] = 5.0  # a likely token in the padded chunk
    probs[1] = 3.0
    rows, rounds = 500, 60
    counts = torch.zeros(vocab)
    for _ in range(rounds):
        tokens = draw(probs.expand(rows, vocab), torch.rand(rows, dtype=torch.float64))
        counts += torch.bincount(tokens, minlength=vocab).float()
    n = rows * rounds
    assert counts.sum() == n
    assert counts[probs == 0].sum() == 0
    ok, chi2, df = _chi_square_ok(counts, probs / probs.sum() * n)
    assert ok, (chi2, df)


def test_the_ends_of_the_unit_interval_take_the_first_and_last_possible_tokens():
    probs = torch.zeros(2, 3000)
    probs[:, [5, 1500, 2990]] = torch.tensor([1.0, 2.0, 1.0])
    below_one = 1.0 - 2.0 ** -53
    tokens = draw(probs, torch.tensor([0.0, below_one], dtype=torch.float64))
    assert tokens.tolist() == [5, 2990]
    # The middle token's share of the interval, [0.25, 0.75).
    middle = draw(probs, torch.tensor([0.25, 0.75 - 1e-12], dtype=torch.float64))
    assert middle.tolist() == [1500, 1500]


@pytest.mark.parametrize("native", [True, False], ids=["native kernel", "pytorch"])
def test_sampled_rows_keep_temperature_and_top_k(kernels, native):
    vocab = 64
    logits = torch.full((vocab,), -4.0)
    logits[[3, 9, 40]] = torch.tensor([2.0, 1.0, 0.5])
    sampler = Sampler(frozenset(), vocab, cpu_fast_paths=native)
    counts = {"plain": torch.zeros(vocab), "top_k": torch.zeros(vocab)}
    params = {"plain": SamplingParams(max_tokens=8, temperature=0.7), "top_k": SamplingParams(max_tokens=8, temperature=1.3, top_k=2)}
    rows = 400
    for _ in range(20):
        names = list(params) * (rows // 2)
        states = [SequenceSamplingState(params[name], [], 0, vocab, "cpu") for name in names]
        tokens, _ = sampler.sample(logits.expand(rows, vocab), states, [0] * rows)
        for name, token in zip(names, tokens):
            counts[name][token] += 1
    n = 20 * rows // 2
    expected = {"plain": torch.softmax(logits / 0.7, -1) * n}
    kept = torch.full((vocab,), float("-inf"))
    kept[[3, 9]] = logits[[3, 9]] / 1.3
    expected["top_k"] = torch.softmax(kept, -1) * n
    for name in params:
        ok, chi2, df = _chi_square_ok(counts[name], expected[name])
        assert ok, (name, chi2, df)
    assert counts["top_k"].sum() == counts["top_k"][[3, 9]].sum()


@pytest.mark.parametrize("top_p", [1.0, 0.9], ids=["temperature only", "top-p"])
def test_a_seeded_row_draws_the_same_tokens_whatever_rows_share_its_step(kernels, top_p):
    vocab = 5000
    torch.manual_seed(1)
    logits = torch.randn(vocab)
    sampler = Sampler(frozenset(), vocab)
    seeded = SamplingParams(max_tokens=8, temperature=1.0, top_p=top_p, seed=1234)
    # Batch-mates of both kinds: rows with temperature alone take the native kernel, rows with top-p PyTorch.
    mates = [SamplingParams(max_tokens=8, temperature=0.8), SamplingParams(max_tokens=8, temperature=1.0, top_p=0.5)]

    def run(batch: int) -> list[int]:
        states = [SequenceSamplingState(seeded, [], 0, vocab, "cpu")]
        states += [SequenceSamplingState(mates[i % 2], [], 0, vocab, "cpu") for i in range(batch)]
        return [sampler.sample(logits.expand(len(states), vocab), states, [0] * len(states))[0][0]
                for _ in range(12)]

    alone = run(0)
    assert run(1) == alone
    assert run(5) == alone
    assert len(set(alone)) > 1  # a real draw, not a constant


def test_the_native_draw_follows_softmax_over_the_temperature(kernels):
    torch.manual_seed(2)
    vocab = 700  # spans of 256, the last one short
    logits = torch.randn(vocab) * 2.0
    logits[::5] = float("-inf")  # impossible tokens
    logits[255] = float("-inf")  # the last token of a span
    for temperature in (1.0, 0.6):
        rows, rounds = 400, 50
        counts = torch.zeros(vocab)
        # A view of wider rows, as the sampler passes the logits of a vocabulary padded past the tokenizer's.
        wide = torch.zeros(rows, vocab + 13)
        wide[:, :vocab] = logits
        scale = torch.full((rows,), 1.0 / temperature)
        for _ in range(rounds):
            tokens = kernels.draw_tokens(wide[:, :vocab], scale, torch.rand(rows, dtype=torch.float64))
            counts += torch.bincount(tokens, minlength=vocab).float()
        assert counts[logits == float("-inf")].sum() == 0
        ok, chi2, df = _chi_square_ok(counts, torch.softmax(logits / temperature, -1) * rows * rounds)
        assert ok, (temperature, chi2, df)
