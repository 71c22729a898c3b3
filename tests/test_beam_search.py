"""Beam search in the batching engine equals transformers' beam search on the embedded model (float32), and
runs next to other requests; its request forms and their 400s over the real gateway."""
from __future__ import annotations

import asyncio

import pytest
import torch

from engine import SamplingParams
from engine_helpers import chat_ids, generate, greedy

PROMPTS = ("Name three colours.", "Write a haiku about the sea.")


@pytest.fixture(scope="module")
def engine(worker):
    return worker.engine


@pytest.fixture(scope="module")
def reference(worker):
    from transformers import AutoModelForCausalLM

    from engine.loader import model_folder
    return AutoModelForCausalLM.from_pretrained(model_folder(worker.settings.engine_config()),
                                                dtype=torch.float32).eval()


def beams(width: int, n: int, max_tokens: int = 12, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, n=n, best_of=width, beam_search=True,
                          logprobs=0, **kw)


def transformers_beams(reference, engine, ids: list[int], width: int, n: int, max_tokens: int,
                       **kw) -> list[list[int]]:
    eos = sorted(engine.tokenizer.eos_token_ids)
    with torch.inference_mode():
        out = reference.generate(torch.tensor([ids]), num_beams=width, num_return_sequences=n, do_sample=False,
                                 max_new_tokens=max_tokens, eos_token_id=eos, pad_token_id=eos[0], **kw)
    result = []
    for row in out[:, len(ids):].tolist():
        while row and row[-1] == eos[0] and len(row) > 1 and row[-2] == eos[0]:
            row.pop()  # padding after an early finished beam
        result.append(row)
    return result


def _trim(ids: list[int], eos: frozenset[int]) -> list[int]:
    """transformers pads a shorter beam with EOS; the engine's beam ends at its EOS."""
    for i, t in enumerate(ids):
        if t in eos:
            return ids[:i + 1]
    return ids


@pytest.mark.slow
@pytest.mark.parametrize("width,n,max_tokens,settings", [
    (2, 2, 10, {}),
    (4, 3, 14, {"length_penalty": 0.5, "early_stopping": True}),
    (3, 1, 40, {"length_penalty": 2.0, "early_stopping": "never"}),
])
def test_beams_equal_transformers(engine, reference, width, n, max_tokens, settings):
    # Run both prompts at once next to a greedy request: beams share steps with other work.
    prompts = [chat_ids(engine, p) for p in PROMPTS]

    async def together():
        return await asyncio.gather(
            *(generate(engine, f"beam-{width}-{i}", ids, beams(width, n, max_tokens, **settings))
              for i, ids in enumerate(prompts)),
            generate(engine, f"beside-{width}", prompts[0], greedy(8)))

    *results, _ = asyncio.run(together())
    eos = engine.tokenizer.eos_token_ids
    for ids, result in zip(prompts, results):
        expected = transformers_beams(reference, engine, ids, width, n, max_tokens, **settings)
        got = [c["ids"] for c in result["choices"]]
        assert [_trim(e, eos) for e in expected] == got
        assert result["outputs"] == 1  # nothing streams before the search ends
        for c in result["choices"]:
            assert len(c["logprobs"]) == len(c["ids"]) and all(lp.logprob <= 0 for lp in c["logprobs"])
            assert c["finish"] == ("stop" if c["ids"][-1] in eos else "length")


def reference_beam_search(model, ids: list[int], width: int, groups: int, diversity: float, max_tokens: int,
                          eos: list[int], length_penalty: float = 1.0) -> list[list[int]]:
    """Diverse beam search from its definition, recomputing every beam in full at each step (no cache): per
    group, transformers' candidate and finishing rules; a group's logprobs lowered by `diversity` per earlier
    group's beam that chose the token at this step. transformers 5 keeps group beam search on the Hub only."""
    sub, keep = width // groups, max(2, 1 + len(eos)) * (width // groups)
    state = [{"beams": [list(ids)] * sub, "scores": [0.0] + [-1e9] * (sub - 1), "done": [], "open": True,
              "over": False} for _ in range(groups)]
    for step in range(max_tokens):
        chosen: list[int] = []
        for g in state:
            if g["over"]:
                continue
            with torch.inference_mode():
                logp = torch.log_softmax(model(torch.tensor(g["beams"])).logits[:, -1].float(), dim=-1)
            if chosen:
                logp = logp - diversity * torch.bincount(torch.tensor(chosen), minlength=logp.shape[1]).float()
            top = (logp + torch.tensor(g["scores"]).view(-1, 1)).view(-1).topk(keep)
            cands = [(s, *divmod(i, logp.shape[1])) for s, i in zip(top.values.tolist(), top.indices.tolist())]
            stops = [t in eos or step + 1 >= max_tokens for _, _, t in cands]
            order = sorted(range(keep), key=lambda i: cands[i][0] - 1e9 * stops[i], reverse=True)[:sub]
            if g["open"]:
                g["done"] += [(s / (step + 1) ** length_penalty, g["beams"][b][len(ids):] + [t])
                              for (s, b, t), stop in zip(cands[:sub], stops) if stop]
                g["done"] = sorted(g["done"], key=lambda h: h[0], reverse=True)[:sub]
            g["beams"] = [g["beams"][cands[i][1]] + [cands[i][2]] for i in order]
            g["scores"] = [cands[i][0] - 1e9 * stops[i] for i in order]
            chosen += [cands[i][2] for i in order]
            worst = g["done"][-1][0] if len(g["done"]) >= sub else -1e9
            g["open"] = g["open"] and g["scores"][0] / (step + 1) ** length_penalty > worst
            g["over"] = not g["open"] or all(stops)
        if all(g["over"] for g in state):
            break
    return [h for _, h in sorted((h for g in state for h in g["done"]), key=lambda h: h[0], reverse=True)]


@pytest.mark.slow
def test_group_beam_search_is_diverse_and_matches_its_definition(engine, reference):
    ids = chat_ids(engine, PROMPTS[1])
    eos = sorted(engine.tokenizer.eos_token_ids)
    # The definition above, without groups, is transformers' beam search.
    assert reference_beam_search(reference, ids, 3, 1, 0.0, 8, eos)[:3] == \
        transformers_beams(reference, engine, ids, 3, 3, 8)
    plain = asyncio.run(generate(engine, "plain", ids, beams(4, 4, 10)))
    diverse = asyncio.run(generate(engine, "diverse", ids, beams(4, 4, 10, num_beam_groups=2,
                                                                 diversity_penalty=1.5)))
    got = [c["ids"] for c in diverse["choices"]]
    assert got != [c["ids"] for c in plain["choices"]]
    assert got == reference_beam_search(reference, ids, 4, 2, 1.5, 10, eos)[:4]


@pytest.mark.slow
def test_beam_search_keeps_stop_strings_and_min_tokens(engine):
    ids = chat_ids(engine, PROMPTS[0])
    free = asyncio.run(generate(engine, "free", ids, beams(2, 2, 12)))["choices"][0]
    stop = free["text"][3:6]
    cut = asyncio.run(generate(engine, "cut", ids, beams(2, 1, 12, stop=(stop,))))["choices"][0]
    assert stop not in cut["text"] and cut["finish"] == "stop" and len(cut["ids"]) < 12
    kept = asyncio.run(generate(engine, "kept", ids, beams(2, 1, 12, stop=(stop,),
                                                            include_stop_str_in_output=True)))["choices"][0]
    assert kept["text"] == cut["text"] + stop
    at_least = asyncio.run(generate(engine, "min", ids, beams(2, 2, 12, min_tokens=12)))
    assert all(len(c["ids"]) == 12 for c in at_least["choices"])


# ---------------------------------------------------------------- the request forms

def test_beam_search_request_forms(client):
    from conftest import MODEL
    from api_helpers import bad_request, complete
    vllm = complete(client, prompt="The capital of France is", max_tokens=8, n=2,
                    extra_body={"use_beam_search": True, "best_of": 3})
    assert len(vllm.choices) == 2 and vllm.choices[0].text != vllm.choices[1].text
    assert vllm.usage.completion_tokens == sum(
        len(c.logprobs.tokens) for c in complete(client, prompt="The capital of France is", max_tokens=8, n=2,
                                                 logprobs=1, extra_body={"use_beam_search": True,
                                                                         "best_of": 3}).choices)
    # OVMS's form: best_of > 1 with length_penalty is beam search (equal to vLLM's form with the same penalty).
    ovms = complete(client, prompt="The capital of France is", max_tokens=8, best_of=3, n=2,
                    extra_body={"length_penalty": 1.0})
    assert [c.text for c in ovms.choices] == [c.text for c in vllm.choices]
    bad_request(lambda: complete(client, best_of=2, stream=True, extra_body={"use_beam_search": True}), "stream")
    bad_request(lambda: complete(client, extra_body={"length_penalty": 0.5}), "length_penalty")
    bad_request(lambda: complete(client, extra_body={"use_beam_search": True}), "best_of")
    bad_request(lambda: complete(client, best_of=2, top_p=0.5, extra_body={"use_beam_search": True}), "top_p")
    bad_request(lambda: complete(client, best_of=4, extra_body={"use_beam_search": True, "num_beam_groups": 3,
                                                                  "diversity_penalty": 1.0}), "num_beam_groups")
    reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], n=2,
                                           max_tokens=6, extra_body={"use_beam_search": True})
    assert len(reply.choices) == 2
