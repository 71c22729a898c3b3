"""The engine's grammar matchers on the embedded model's tokenizer (no model run): masks allow exactly what
the grammar allows, EOS only where it may end, the answer gate of reasoning models, compile errors, and the
cache."""
from __future__ import annotations

import json

import pytest
import torch

from engine.sampling.structured import AnswerGate, GrammarCompiler, GrammarError, allocate_bitmask, apply_bitmask

EOS = 2  # <|im_end|>


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from engine.config import EngineConfig
    from engine.loader import model_folder
    return AutoTokenizer.from_pretrained(model_folder(EngineConfig()))


@pytest.fixture(scope="module")
def compiler(tokenizer):
    return GrammarCompiler(tokenizer, frozenset({EOS}), len(tokenizer))


def allowed(matcher, vocab: int) -> set[int]:
    bitmask = allocate_bitmask(1, vocab)
    matcher.fill_bitmask(bitmask, 0)
    logits = torch.zeros(1, vocab)
    apply_bitmask(logits, bitmask, [0])
    return set(torch.nonzero(logits[0] == 0).view(-1).tolist())


def ids(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def test_mask_follows_the_grammar_and_eos_comes_only_at_the_end(tokenizer, compiler):
    spec = compiler.compile("choice", json.dumps(["yes", "no"]))
    matcher = spec.new_matcher()
    first = allowed(matcher, len(tokenizer))
    assert EOS not in first
    assert {tokenizer.decode([t]) for t in first} <= {"y", "ye", "yes", "n", "no"}
    for token in ids(tokenizer, "no"):
        assert token in allowed(matcher, len(tokenizer))
        assert not matcher.is_terminated()
        matcher.accept(token)
    assert matcher.is_terminated()  # nothing can follow: the engine stops the sequence with "stop"


def test_open_grammar_allows_eos_once_it_may_end(tokenizer, compiler):
    matcher = compiler.compile("regex", "[0-9]+").new_matcher()
    assert EOS not in allowed(matcher, len(tokenizer))
    matcher.accept(ids(tokenizer, "4")[0])
    assert EOS in allowed(matcher, len(tokenizer)) and not matcher.is_terminated()
    matcher.accept(EOS)
    assert matcher.is_terminated()


def test_a_token_the_grammar_rejects_is_an_error_not_a_silent_pass(tokenizer, compiler):
    matcher = compiler.compile("regex", "[0-9]+").new_matcher()
    matcher.accept(ids(tokenizer, "abc")[0])
    with pytest.raises(RuntimeError, match="grammar rejected"):
        matcher.is_terminated()


def test_answer_gate_leaves_thinking_free_and_constrains_the_answer(tokenizer, compiler):
    spec = compiler.compile("choice", json.dumps(["yes", "no"]))
    think_open, think_close = ids(tokenizer, "<|im_start|>"), ids(tokenizer, "<|im_end|>")
    # Stand-ins for <think> / </think>: single special tokens, as in Qwen3.
    gate = AnswerGate(closer=tuple(think_close), opener=think_open[0])
    vocab = len(tokenizer)

    opened = spec.with_gate(gate).new_matcher()
    first = allowed(opened, vocab)
    assert think_open[0] in first and ids(tokenizer, "no")[0] in first and len(first) < 10
    opened.accept(think_open[0])
    assert len(allowed(opened, vocab)) == vocab  # thinking: anything goes
    for token in ids(tokenizer, "Let me think about it."):
        opened.accept(token)
    assert not opened.is_terminated()
    opened.accept(think_close[0])
    assert think_open[0] not in allowed(opened, vocab)  # the answer is constrained again
    for token in ids(tokenizer, "yes"):
        opened.accept(token)
    assert opened.is_terminated()

    direct = spec.with_gate(gate).new_matcher()  # a model that answers without thinking is constrained at once
    for token in ids(tokenizer, "no"):
        direct.accept(token)
    assert direct.is_terminated()

    inside = spec.with_gate(AnswerGate(closer=tuple(think_close), inside=True)).new_matcher()
    assert len(allowed(inside, vocab)) == vocab


@pytest.mark.parametrize("kind,text,words", [
    ("json_schema", json.dumps({"type": "array", "uniqueItems": True}), ["uniqueItems"]),
    ("json_schema", json.dumps({"type": "object", "if": {}, "then": {}}), ["if"]),
    ("json_schema", "{nope", ["JSON"]),
    ("regex", "a{3", []),
    ("grammar", "start: x", ["x"]),
    ("grammar", 'root ::= "a" [0-9]+', []),  # GBNF is taken too
])
def test_compile_errors_name_the_problem(compiler, kind, text, words):
    if kind == "grammar" and "::=" in text:
        assert compiler.compile(kind, text) is not None
        return
    with pytest.raises(GrammarError) as info:
        compiler.compile(kind, text)
    for word in words:
        assert word in str(info.value)


def test_compiled_grammars_are_cached_by_constraint(compiler):
    schema = json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}})
    assert compiler.compile("json_schema", schema) is compiler.compile("json_schema", schema)
    assert compiler.compile("json_schema", schema) is not compiler.compile("json_schema", schema, r"[ ]?")


@pytest.mark.parametrize("pattern,text,matches", [
    (None, '{"a": 1, "b": 2}', True), (None, '{"a":1,"b":2}', False),
    ("", '{"a":1,"b":2}', True), ("", '{"a": 1, "b": 2}', False),
    (r"[ \n]{0,2}", '{\n "a": 1,\n "b": 2\n}', True),
])
def test_json_whitespace(tokenizer, compiler, pattern, text, matches):
    schema = json.dumps({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                         "required": ["a", "b"], "additionalProperties": False})
    matcher = compiler.compile("json_schema", schema, pattern).new_matcher()
    for token in ids(tokenizer, text):
        matcher.accept(token)
    if matches:
        assert matcher.is_terminated()
    else:
        with pytest.raises(RuntimeError, match="rejected"):
            matcher.is_terminated()
