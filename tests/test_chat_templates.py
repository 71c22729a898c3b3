"""CUSTOM_CHAT_TEMPLATE replaces the model's template; templates render in a sandbox; message content is data.

Workers here are built from environment variables exactly as handler.py builds its own, on a small random model
(tests/tiny_models.py) that generates deterministically under greedy decoding.
"""
from __future__ import annotations


import pytest

from tiny_models import build_small_model
from api_helpers import GREEDY, Worker

PASSTHROUGH = "{% for message in messages %}{{ message['content'] }}{% endfor %}"
MODEL_TEMPLATE = "<|model template|>{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
TEXT = "The capital of France is"


@pytest.fixture(scope="module")
def plain_model(tmp_path_factory):
    """A model whose tokenizer has no chat template."""
    return build_small_model(tmp_path_factory.mktemp("plain-model"))


@pytest.fixture(scope="module")
def templated_model(tmp_path_factory):
    return build_small_model(tmp_path_factory.mktemp("templated-model"), chat_template=MODEL_TEMPLATE)


def assert_same_generation(chat: dict, completion: dict) -> None:
    assert chat["choices"][0]["message"]["content"] == completion["choices"][0]["text"]
    assert chat["usage"] == completion["usage"]
    assert chat["usage"]["completion_tokens"] == GREEDY["max_tokens"]


def test_passthrough_template_gives_the_plain_completion(plain_model, tmp_path, monkeypatch):
    worker = Worker(monkeypatch, tmp_path, MODEL_NAME=str(plain_model), CUSTOM_CHAT_TEMPLATE=PASSTHROUGH)
    assert_same_generation(worker.chat(TEXT), worker.complete(TEXT))


@pytest.mark.slow
@pytest.mark.parametrize("content", [
    TEXT,
    "{{ 7*7 }}",
    "{% for x in range(3) %}x{% endfor %}",
    "{{ messages }} {{ raise_exception('no') }}",
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
])
def test_custom_template_replaces_the_models_own_and_content_stays_text(templated_model, tmp_path, monkeypatch,
                                                                        content):
    own = Worker(monkeypatch, tmp_path, MODEL_NAME=str(templated_model))
    assert own.render(content) == f"<|model template|>[user] {content}\n"
    custom = Worker(monkeypatch, tmp_path, MODEL_NAME=str(templated_model), CUSTOM_CHAT_TEMPLATE=PASSTHROUGH)
    assert custom.render(content) == content
    assert_same_generation(custom.chat(content), custom.complete(content))


@pytest.mark.slow
@pytest.mark.parametrize("template", [
    "{{ messages.__class__.__mro__[-1].__subclasses__() }}",
    "{{ cycler.__init__.__globals__.os.popen('id').read() }}",
    "{% for m in messages %}{{ m.update({'role': 'system'}) }}{% endfor %}",
])
def test_templates_render_in_a_sandbox(plain_model, tmp_path, monkeypatch, template):
    worker = Worker(monkeypatch, tmp_path, MODEL_NAME=str(plain_model), CUSTOM_CHAT_TEMPLATE=template)
    error = worker.chat(TEXT)["error"]
    assert error["code"] == 400 and "chat template failed" in error["message"]
    assert "unsafe" in error["message"] or "not safely callable" in error["message"]
    assert worker.complete(TEXT)["usage"]["completion_tokens"] == GREEDY["max_tokens"]  # still serving


def test_model_without_template_serves_completions_and_refuses_chat(plain_model, tmp_path, monkeypatch):
    worker = Worker(monkeypatch, tmp_path, MODEL_NAME=str(plain_model))
    assert worker.complete(TEXT)["usage"]["completion_tokens"] == GREEDY["max_tokens"]
    for body in (worker.chat(TEXT), worker.job({"messages": [{"role": "user", "content": TEXT}]}),
                 worker.job({"prompt": TEXT, "apply_chat_template": True})):
        assert body["error"]["code"] == 400
        assert "no chat template" in body["error"]["message"] and "CUSTOM_CHAT_TEMPLATE" in body["error"]["message"]


def test_invalid_custom_template_stops_start_up(monkeypatch):
    from worker.settings import SettingsError, load_settings

    monkeypatch.setenv("CUSTOM_CHAT_TEMPLATE", "{% for m in messages %}{{ m['content'] }")
    with pytest.raises(SettingsError) as failure:
        load_settings()
    assert "CUSTOM_CHAT_TEMPLATE: not a valid Jinja template" in str(failure.value)
    assert "\n" not in str(failure.value)
    # transformers' own template extensions are valid
    monkeypatch.setenv("CUSTOM_CHAT_TEMPLATE", "{% for m in messages %}{% generation %}{{ m['content'] }}"
                                               "{% endgeneration %}{% if loop.last %}{% break %}{% endif %}"
                                               "{% endfor %}")
    assert load_settings().custom_chat_template.startswith("{% for m")


@pytest.mark.slow
def test_reasoning_effort_reaches_the_template_and_audio_is_refused(plain_model, tmp_path, monkeypatch):
    """reasoning_effort is a template variable (gpt-oss templates read it), as vLLM passes it; what a text model
    cannot do (audio out, web search) is a 400 instead of being ignored."""
    template = "{% if reasoning_effort %}Effort: {{ reasoning_effort }}.{% endif %}{{ messages[-1]['content'] }}"
    worker = Worker(monkeypatch, tmp_path, MODEL_NAME=str(plain_model), CUSTOM_CHAT_TEMPLATE=template)

    def chat(**extra) -> dict:
        return worker.job({"openai_route": "/v1/chat/completions", "openai_input": {
            "messages": [{"role": "user", "content": TEXT}], **GREEDY, **extra}})

    plain = chat()["usage"]["prompt_tokens"]
    assert chat(reasoning_effort="high")["usage"]["prompt_tokens"] > plain
    assert chat(reasoning_effort="high")["choices"][0]["message"]["content"] == \
        worker.complete(f"Effort: high.{TEXT}")["choices"][0]["text"]
    kwargs = chat(reasoning_effort="high", chat_template_kwargs={"reasoning_effort": "low"})
    assert kwargs["choices"][0]["message"]["content"] == worker.complete(f"Effort: low.{TEXT}")["choices"][0]["text"]
    for extra, param in (({"modalities": ["text", "audio"]}, "modalities"), ({"audio": {"voice": "alloy"}}, "audio"),
                         ({"web_search_options": {}}, "web_search_options"),
                         ({"reasoning_effort": "extreme"}, "reasoning_effort")):
        error = chat(**extra)["error"]
        assert error["code"] == 400 and error["param"].startswith(param), error
    assert chat(modalities=["text"])["usage"]["prompt_tokens"] == plain
