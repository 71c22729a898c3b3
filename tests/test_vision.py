"""Vision-language models: image parts in chat, Responses and Messages requests, served by tiny random models of
ten families (tests/vision_models.py). The worker's greedy tokens must equal transformers' `generate` given the
same processor inputs, for one image, two images, an image in an earlier turn, several choices, and concurrent
mixes of image and text requests; `detail: low` shows the processor a smaller picture; bad images, the URL
fetcher's limits and the per-prompt limit are 400s naming the part, after which the worker keeps serving."""
from __future__ import annotations

import asyncio
import base64
import io
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
import torch
import transformers
from PIL import Image

from api_helpers import Worker
from engine.core.fallback import FallbackEngine
from engine.core.loop import Engine
from conftest import start_gateway, stop_gateway
from vision_models import FAMILIES, build, reference_processor

NEW = 6
# The families whose whole model runs on the fallback loop (written out here, not read from the engine's list, so a
# family that silently leaves the paged path fails its tests).
FALLBACK = ("gemma3", "paligemma", "qwen3_vl")


def picture(seed: int, size=(40, 52)) -> Image.Image:
    return Image.fromarray(np.random.RandomState(seed).randint(0, 255, (*size, 3), dtype=np.uint8))


def encoded(image: Image.Image, fmt: str = "PNG") -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt)
    return buffer.getvalue()


def data_url(image: Image.Image, fmt: str = "PNG") -> str:
    return f"data:image/{fmt.lower()};base64,{base64.b64encode(encoded(image, fmt)).decode()}"


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


@pytest.fixture(scope="module")
def folders(tmp_path_factory, tokenizer_folder):
    root = tmp_path_factory.mktemp("vlm")
    return {family: build(family, tokenizer_folder, root / family) for family in FAMILIES}


class Reference:
    """transformers' own: the processor renders and encodes the conversation, `generate` continues it."""

    def __init__(self, folder):
        self.processor = reference_processor(folder)
        self.model = transformers.AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval()

    def render(self, messages: list[dict]) -> str:
        if isinstance(self.processor, transformers.SmolVLMProcessor):
            # Its apply_chat_template reads the video processor's settings, which it has not here (torchvision).
            return self.processor.tokenizer.apply_chat_template(messages, chat_template=self.processor.chat_template,
                                                                add_generation_prompt=True, tokenize=False)
        return self.processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)

    def tokens(self, messages: list[dict], images: list[Image.Image], new: int = NEW) -> tuple[list[int], list[int]]:
        """(prompt ids, greedy new ids) for messages in the processor's form ({"type": "image"} parts)."""
        text = self.render(messages)
        if images:
            inputs = self.processor(text=[text], images=[images], return_tensors="pt", add_special_tokens=False)
        else:
            inputs = self.processor.tokenizer([text], return_tensors="pt", add_special_tokens=False)
        inputs.pop("labels", None)
        with torch.no_grad():
            out = self.model.generate(**inputs, max_new_tokens=new, do_sample=False)
        prompt = inputs["input_ids"][0].tolist()
        return prompt, out[0, len(prompt):].tolist()


def as_reference(messages: list[dict]) -> list[dict]:
    """The request's messages as the processor takes them: image parts become {"type": "image"}."""
    out = []
    for message in messages:
        content = message["content"]
        if isinstance(content, list):
            content = [{"type": "image"} if part["type"] == "image_url" else part for part in content]
        out.append({"role": message["role"], "content": content})
    return out


def chat_job(messages, **extra) -> dict:
    return {"openai_route": "/v1/chat/completions",
            "openai_input": {"messages": messages, "max_tokens": NEW, "temperature": 0, "ignore_eos": True,
                             "return_token_ids": True, **extra}}


ONE = [{"role": "user", "content": [image_part("A"), {"type": "text", "text": "What is in the picture?"}]}]
TWO = [{"role": "user", "content": [{"type": "text", "text": "Compare"}, image_part("A"), {"type": "text",
                                                                                            "text": "with"},
                                    image_part("B")]}]
EARLIER = [ONE[0], {"role": "assistant", "content": "A cat."}, {"role": "user", "content": "And its colour?"}]


def with_images(messages, urls: dict[str, str]) -> list[dict]:
    def part(p):
        return image_part(urls[p["image_url"]["url"]]) if p["type"] == "image_url" else p
    return [{**m, "content": [part(p) for p in m["content"]] if isinstance(m["content"], list) else m["content"]}
            for m in messages]


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_greedy_tokens_equal_generate(family, folders, monkeypatch, tmp_path):
    worker = Worker(monkeypatch, tmp_path, MODEL_NAME=str(folders[family]), DTYPE="float32")
    reference = Reference(folders[family])
    a, b = picture(1), picture(2, (60, 30))
    urls = {"A": data_url(a), "B": data_url(b, "JPEG")}
    b_seen = Image.open(io.BytesIO(encoded(b, "JPEG"))).convert("RGB")  # what the worker decodes
    for messages, images in ((ONE, [a]), (TWO, [a, b_seen]), (EARLIER, [a])):
        out = worker.job(chat_job(with_images(messages, urls)))
        prompt, expected = reference.tokens(as_reference(messages), images)
        assert out["prompt_token_ids"] == prompt, family
        assert out["choices"][0]["token_ids"] == expected, (family, messages)
        assert out["usage"]["prompt_tokens"] == len(prompt)
        if family == "mistral3" and messages is ONE:  # 40x52 pixels: 3 rows of 4 merged 14-pixel patches
            img, brk, end = reference.processor.ids
            grid = [img] * 4 + [brk] + [img] * 4 + [brk] + [img] * 4 + [end]
            start = prompt.index(img)
            assert prompt[start:start + len(grid)] == grid and prompt.count(img) == 12
    # LLaVA-style families, Mistral 3, Qwen2-VL and Qwen2.5-VL run their decoder on the paged engine; the others
    # (bidirectional attention over an image, Qwen3-VL's deepstack features) the whole model on the fallback.
    assert isinstance(worker.engine.engine, FallbackEngine if family in FALLBACK else Engine)
    # Several choices share the prompt's images; a text-only request to a vision model is plain text.
    out = worker.job(chat_job(with_images(ONE, urls), n=2))
    assert [c["token_ids"] for c in out["choices"]] == [reference.tokens(as_reference(ONE), [a])[1]] * 2
    text_only = [{"role": "user", "content": "Hello there"}]
    assert worker.job(chat_job(text_only))["choices"][0]["token_ids"] == reference.tokens(text_only, [])[1]


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llava", "mistral3", "qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def test_concurrent_image_and_text_requests_batch_and_each_equals_generate(family, folders, monkeypatch, tmp_path):
    """LLaVA's, Mistral 3's, Qwen2-VL's and Qwen2.5-VL's decoders run batched on the paged engine, each Qwen
    request decoding with its own multimodal rotary offset (pictures of different shapes give different offsets;
    the 30x120 one spans several of Qwen2.5-VL's attention windows); Qwen3-VL's requests take turns on the
    fallback loop."""
    worker = Worker(monkeypatch, tmp_path, MODEL_NAME=str(folders[family]), DTYPE="float32", MAX_NUM_SEQS="8")
    reference = Reference(folders[family])
    pictures = [picture(10 + i, size) for i, size in enumerate([(40, 52), (90, 30), (30, 120)])]
    requests = [
        ([{"role": "user", "content": [image_part(data_url(pictures[0])), {"type": "text", "text": "Describe"}]}],
         [pictures[0]]),
        ([{"role": "user", "content": "Tell me a story"}], []),
        ([{"role": "user", "content": [image_part(data_url(pictures[1])), image_part(data_url(pictures[2])),
                                       {"type": "text", "text": "Which differs?"}]}], pictures[1:]),
        ([{"role": "user", "content": "Count to five"}], []),
        ([{"role": "user", "content": [image_part(data_url(pictures[2])), {"type": "text", "text": "Describe"}]}],
         [pictures[2]]),
    ]

    async def run_all():
        async def one(messages):
            return [part async for part in worker.router.run(chat_job(messages))][0]
        await worker.engine.start()
        return await asyncio.gather(*(one(messages) for messages, _ in requests))

    outputs = asyncio.run(run_all())
    assert isinstance(worker.engine.engine, FallbackEngine if family in FALLBACK else Engine)
    assert worker.engine.stats()["num_requests"] == 0
    for (messages, images), out in zip(requests, outputs):
        assert out["choices"][0]["token_ids"] == reference.tokens(as_reference(messages), images)[1]
    # A different picture is a different prompt: same text, different tokens.
    assert outputs[0]["choices"][0]["token_ids"] != outputs[4]["choices"][0]["token_ids"]

    # Logprobs are the model's own for the prompt with its image; a grammar holds with an image in the prompt.
    messages, images = requests[0]
    out = worker.job(chat_job(messages, logprobs=True, top_logprobs=2, max_tokens=1))
    text = reference.render(as_reference(messages))
    inputs = reference.processor(text=[text], images=[images], return_tensors="pt", add_special_tokens=False)
    with torch.no_grad():  # over the tokenizer's ids: the worker never samples the embedding table's padding rows
        logits = reference.model(**inputs).logits[0, -1, :len(reference.processor.tokenizer)]
        expected = torch.log_softmax(logits.float(), -1)
    token = out["choices"][0]["token_ids"][0]
    assert out["choices"][0]["logprobs"]["content"][0]["logprob"] == pytest.approx(expected[token].item(), abs=1e-4)
    schema = {"type": "object", "properties": {"colour": {"enum": ["red", "blue"]}}, "required": ["colour"],
              "additionalProperties": False}
    out = worker.job(chat_job(messages, max_tokens=30, ignore_eos=False, response_format={
        "type": "json_schema", "json_schema": {"name": "c", "schema": schema}}))
    assert json.loads(out["choices"][0]["message"]["content"])["colour"] in ("red", "blue")


class _Server(ThreadingHTTPServer):
    daemon_threads = True


def _serve(png: bytes):
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_GET(self):
            if self.path == "/loop":
                self.send_response(302)
                self.send_header("Location", "/loop")
                self.end_headers()
            elif self.path == "/hop":
                self.send_response(302)
                self.send_header("Location", "/ok.png")
                self.end_headers()
            elif self.path == "/slow":
                time.sleep(3)
                self.send_response(200)
                self.end_headers()
            else:
                body = png if self.path == "/ok.png" else b"x" * 50_000
                self.send_response(200)
                self.send_header("Content-Type", "image/png")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

    server = _Server(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def _error(out: dict, param: str, *words: str) -> None:
    error = out["error"]
    assert (error["code"], error["param"]) == (400, param), error
    for word in words:
        assert word in error["message"], error


@pytest.mark.slow
def test_bad_images_fetch_limits_and_the_limit_per_prompt_are_400s_naming_the_part(folders, monkeypatch, tmp_path):
    small = picture(5, (8, 8))
    server = _serve(encoded(small))
    base = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        worker = Worker(monkeypatch, tmp_path, MODEL_NAME=str(folders["llava"]), DTYPE="float32",
                        MEDIA_ALLOW_PRIVATE="true", MEDIA_MAX_BYTES="4000", MEDIA_FETCH_TIMEOUT="1",
                        MEDIA_MAX_REDIRECTS="2", LIMIT_MM_PER_PROMPT='{"image": 2}')
        reference = Reference(folders["llava"])

        def ask(*urls, text="Look"):
            return worker.job(chat_job([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yes"},
                                        {"role": "user", "content": [{"type": "text", "text": text},
                                                                     *map(image_part, urls)]}]))

        bmp = data_url(small, "BMP").replace("image/bmp", "image/png")
        cases = [
            (ask("data:image/png;base64,@@not base64@@"), "messages[2].content[1]", "corrupt"),
            (ask("data:image/png;base64," + base64.b64encode(b"hello").decode()), "messages[2].content[1]",
             "not an image"),
            (ask("data:image/tiff;base64,AAAA"), "messages[2].content[1]", "unsupported image type"),
            (ask(bmp), "messages[2].content[1]", "not an image"),
            (ask(data_url(small), data_url(picture(6))), "messages[2].content[2]", "larger than the limit"),
            (ask(*[data_url(small)] * 3), "messages[2].content[3]", "LIMIT_MM_PER_PROMPT"),
            (ask(f"{base}/big"), "messages[2].content[1]", "larger than the limit"),
            (ask(f"{base}/slow"), "messages[2].content[1]", "longer than 1 s"),
            (ask(f"{base}/loop"), "messages[2].content[1]", "redirects"),
            (ask(f"{base}/missing-is-big-too", "ftp://example.com/a.png"), "messages[2].content[2]", "http(s)"),
        ]
        for out, param, word in cases:
            _error(out, param, word)
        # The worker keeps serving: a fetched image (loopback allowed here), through a redirect, and a data URL.
        messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yes"},
                    {"role": "user", "content": [{"type": "text", "text": "Look"}, {"type": "image"}, {"type": "image"}]}]
        expected = reference.tokens(messages, [small, small])[1]
        assert ask(f"{base}/hop", data_url(small))["choices"][0]["token_ids"] == expected

        # Without MEDIA_ALLOW_PRIVATE, loopback is refused by address and by a name that resolves to it.
        monkeypatch.delenv("MEDIA_ALLOW_PRIVATE")
        strict = Worker(monkeypatch, tmp_path, MODEL_NAME=str(folders["llava"]), DTYPE="float32")
        for url in (f"{base}/ok.png", f"http://localhost:{server.server_address[1]}/ok.png", "http://[::1]/x.png",
                    "http://169.254.169.254/latest/meta-data"):
            out = strict.job(chat_job([{"role": "user", "content": [image_part(url)]}]))
            _error(out, "messages[0].content[0]", "private, loopback or link-local")
    finally:
        server.shutdown()


@pytest.mark.slow
def test_official_clients_over_http_chat_responses_messages_and_tokenize(folders):
    import anthropic
    import httpx
    from openai import OpenAI

    reference = Reference(folders["idefics3"])
    image = picture(7)
    url = data_url(image)
    process, base = start_gateway({"MODEL_NAME": str(folders["idefics3"]), "DTYPE": "float32",
                                   "OPENAI_SERVED_MODEL_NAME_OVERRIDE": "m"})
    try:
        client = OpenAI(base_url=base, api_key="unused", max_retries=0, timeout=120)
        prompt, expected = reference.tokens([{"role": "user", "content": [{"type": "image"}, {
            "type": "text", "text": "What is it?"}]}], [image])
        text = reference.processor.tokenizer.decode(expected, skip_special_tokens=True)
        chat = client.chat.completions.create(model="m", max_tokens=NEW, temperature=0, messages=[
            {"role": "user", "content": [image_part(url), {"type": "text", "text": "What is it?"}]}],
            extra_body={"ignore_eos": True, "return_token_ids": True})
        assert chat.choices[0].model_extra["token_ids"] == expected
        assert chat.usage.prompt_tokens == len(prompt)
        stream = client.chat.completions.create(model="m", max_tokens=NEW, temperature=0, stream=True, messages=[
            {"role": "user", "content": [image_part(url), {"type": "text", "text": "What is it?"}]}],
            extra_body={"ignore_eos": True})
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == text
        response = client.responses.create(model="m", max_output_tokens=NEW, temperature=0, input=[
            {"role": "user", "content": [{"type": "input_image", "image_url": url},
                                         {"type": "input_text", "text": "What is it?"}]}],
            extra_body={"ignore_eos": True})
        assert response.output_text == text and response.usage.input_tokens == len(prompt)
        claude = anthropic.Anthropic(base_url=base.removesuffix("/v1"), api_key="unused", max_retries=0)
        message = claude.messages.create(model="m", max_tokens=NEW, messages=[
            {"role": "user", "content": [
                {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                             "data": url.split(",", 1)[1]}},
                {"type": "text", "text": "What is it?"}]}], extra_body={"temperature": 0})
        assert message.content[0].text == text and message.usage.input_tokens == len(prompt)
        tokens = httpx.post(base.removesuffix("/openai/v1") + "/tokenize", json={"model": "m", "messages": [
            {"role": "user", "content": [image_part(url), {"type": "text", "text": "What is it?"}]}],
            "add_generation_prompt": True}, timeout=60).json()
        assert tokens["tokens"] == prompt and tokens["count"] == len(prompt)
        bad = httpx.post(base + "/responses", json={"model": "m", "input": [{"role": "user", "content": [
            {"type": "input_image", "image_url": "data:image/png;base64,AAAA"}]}]}, timeout=60)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "input[0].content[0]", bad.text
        bad = httpx.post(base.removesuffix("/v1") + "/v1/messages", json={"model": "m", "max_tokens": 4, "messages": [
            {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "image", "source": {
                "type": "base64", "media_type": "image/png", "data": "AAAA"}}]}]}, timeout=60)
        assert bad.status_code == 400 and "messages[0].content[1]" in bad.text, bad.text
    finally:
        stop_gateway(process)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llava", "mistral3", "qwen2_vl"])
def test_prefix_cache_reuses_an_image_in_a_later_turn_and_never_a_different_image(family, folders, monkeypatch,
                                                                                  tmp_path):
    worker = Worker(monkeypatch, tmp_path, MODEL_NAME=str(folders[family]), DTYPE="float32")
    reference = Reference(folders[family])
    first, other = picture(21), picture(22)
    long_text = "Describe every part of this picture in detail, please, with care"

    def turn(image, later: bool):
        messages = [{"role": "user", "content": [image_part(data_url(image)), {"type": "text", "text": long_text}]}]
        if later:
            messages += [{"role": "assistant", "content": "It is noise."}, {"role": "user", "content": "More?"}]
        return messages

    def hits():
        return worker.engine.stats()["prefix_cache_hit_tokens"]

    asyncio.run(worker.engine.start())
    assert isinstance(worker.engine.engine, Engine)

    for image, later, cached in ((first, False, False), (first, True, True), (other, True, False)):
        before = hits()
        out = worker.job(chat_job(turn(image, later)))
        assert out["choices"][0]["token_ids"] == reference.tokens(as_reference(turn(image, later)), [image])[1]
        assert (hits() > before) == cached, (later, hits() - before)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llava_next", "mistral3", "qwen2_vl", "qwen2_5_vl"])
def test_prompt_chunks_that_split_an_image_block_equal_generate(family, folders, monkeypatch, tmp_path):
    """Prompts prefilled 16 tokens at a time, so a chunk ends inside an image's block of tokens (for Mistral 3, a
    block with [IMG_BREAK] tokens between its rows of image positions; for the Qwen VL families, a block whose
    multimodal rotary positions run over the image's rows and columns, continued in the next chunk)."""
    worker = Worker(monkeypatch, tmp_path, MODEL_NAME=str(folders[family]), DTYPE="float32",
                    MAX_NUM_SEQS="4", MAX_NUM_BATCHED_TOKENS="16")
    reference = Reference(folders[family])
    a, b = picture(31), picture(32, (60, 30))
    urls = {"A": data_url(a), "B": data_url(b)}
    image_token = reference.model.config.image_token_id
    block = set(reference.processor.ids[:2]) if family == "mistral3" else {image_token}
    split = 0
    for messages, images in ((ONE, [a]), (TWO, [a, b])):
        prompt, expected = reference.tokens(as_reference(messages), images)
        split += prompt[15] in block and prompt[16] in block  # the first chunk ends inside an image's block
        assert worker.job(chat_job(with_images(messages, urls)))["choices"][0]["token_ids"] == expected
    assert split
    assert isinstance(worker.engine.engine, Engine)


@pytest.mark.slow
def test_qwen2_vl_requests_preempted_and_recomputed_equal_generate(folders, monkeypatch, tmp_path):
    """A KV cache of 128 tokens (8 blocks) for five image requests of about 75 tokens each: some are preempted and
    recomputed, generated tokens included, whose rotary positions run on from the prompt's (index plus the
    prompt's offset) while the prompt's keep their 3-D ones. Each token and its logprob are generate's (the
    logprobs are what a wrong position would move; the tiny model's greedy choice can survive it)."""
    per_token = 2 * 2 * 2 * 16 * 4  # keys and values, 2 layers, 2 KV heads of 16, float32 (vision_models._TEXT)
    new = 48
    worker = Worker(monkeypatch, tmp_path, MODEL_NAME=str(folders["qwen2_vl"]), DTYPE="float32",
                    KV_CACHE_MEMORY=str(128 * per_token), MAX_MODEL_LEN="128", MAX_NUM_SEQS="5")
    reference = Reference(folders["qwen2_vl"])
    sizes = [(112, 112), (84, 140), (140, 84), (98, 98), (56, 168)]  # different rotary offsets (-10 and -12 among them)
    pictures = [picture(60 + i, size) for i, size in enumerate(sizes)]
    requests = [[{"role": "user", "content": [image_part(data_url(p)), {"type": "text", "text": "Describe"}]}]
                for p in pictures]

    async def run_all():
        async def one(messages):
            return [part async for part in worker.router.run(chat_job(messages, max_tokens=new, logprobs=True))][0]
        await worker.engine.start()
        return await asyncio.gather(*(one(messages) for messages in requests))

    outputs = asyncio.run(run_all())
    assert isinstance(worker.engine.engine, Engine)
    assert worker.engine.stats()["preemptions"] > 0, "the budget was meant to force preemption"
    vocab = len(reference.processor.tokenizer)
    for messages, image, out in zip(requests, pictures, outputs):
        text = reference.render(as_reference(messages))
        inputs = reference.processor(text=[text], images=[[image]], return_tensors="pt", add_special_tokens=False)
        with torch.no_grad():
            generated = reference.model.generate(**inputs, max_new_tokens=new, do_sample=False, output_logits=True,
                                                 return_dict_in_generate=True)
        expected = generated.sequences[0, inputs["input_ids"].shape[1]:].tolist()
        choice = out["choices"][0]
        assert choice["token_ids"] == expected
        for token, got, logits in zip(expected, choice["logprobs"]["content"], generated.logits):
            logprob = torch.log_softmax(logits[0, :vocab].float(), -1)[token].item()
            # 1e-3: float32 sums in another order (transformers' own teacher-forced pass differs from its generate
            # by up to 1e-4 here); a rotary position off by one moves these logprobs by whole units.
            assert got["logprob"] == pytest.approx(logprob, abs=1e-3)


@pytest.mark.slow
def test_detail_low_shows_the_processor_a_512_pixel_view_and_tokenize_counts_its_image_tokens(folders, monkeypatch,
                                                                                             tmp_path):
    """Qwen2-VL's image-token count follows the picture's size: `detail: low` on a 640x480 picture is its
    512x384 view (bicubic), so fewer image tokens than `high` or `auto` (the processor's own resolution), and
    the tokens are generate's on that view. /tokenize counts the same image tokens."""
    worker = Worker(monkeypatch, tmp_path, MODEL_NAME=str(folders["qwen2_vl"]), DTYPE="float32")
    reference = Reference(folders["qwen2_vl"])
    large = picture(41, (480, 640))
    url = data_url(large)
    low_view = large.resize((512, 384), Image.Resampling.BICUBIC)
    image_token = reference.model.config.image_token_id
    counts = {}
    for detail, seen in (("low", low_view), ("high", large), ("auto", large), (None, large)):
        part = {"type": "image_url", "image_url": {"url": url, **({"detail": detail} if detail else {})}}
        messages = [{"role": "user", "content": [part, {"type": "text", "text": "What is it?"}]}]
        prompt, expected = reference.tokens(as_reference(messages), [seen])
        out = worker.job(chat_job(messages))
        assert out["prompt_token_ids"] == prompt and out["choices"][0]["token_ids"] == expected, detail
        assert out["usage"]["prompt_tokens"] == len(prompt)
        counts[detail] = prompt.count(image_token)
        tokens = worker.job({"openai_route": "/tokenize", "openai_input": {
            "messages": messages, "add_generation_prompt": True}})
        assert tokens["tokens"] == prompt and tokens["count"] == len(prompt), detail
    # 640x480 is 23x17 merged patches of 28 pixels at the processor's resolution, 512x384 is 18x14.
    assert counts == {"low": 18 * 14, "high": 23 * 17, "auto": 23 * 17, None: 23 * 17}
    # A Responses input_image carries its detail too.
    out = worker.job({"openai_route": "/v1/responses", "openai_input": {
        "input": [{"role": "user", "content": [{"type": "input_image", "image_url": url, "detail": "low"},
                                               {"type": "input_text", "text": "What is it?"}]}],
        "max_output_tokens": NEW, "temperature": 0, "ignore_eos": True}})
    assert out["usage"]["input_tokens"] == len(reference.tokens(as_reference(
        [{"role": "user", "content": [image_part(url), {"type": "text", "text": "What is it?"}]}]), [low_view])[0])
    bad = worker.job(chat_job([{"role": "user", "content": [{"type": "image_url", "image_url": {
        "url": url, "detail": "medium"}}]}]))
    _error(bad, "messages[0].content[0].image_url.detail", "auto, low or high")


@pytest.mark.slow
def test_a_qwen2_vl_folder_saved_with_its_video_processor_is_served(folders, monkeypatch, tmp_path):
    """A Qwen2-VL folder as transformers saves the full processor (the video processor's settings in
    processor_config.json and video_preprocessor_config.json, which need torchvision to load): the worker loads
    it without them, and its tokens are still generate's."""
    import shutil

    folder = tmp_path / "qwen2_vl_with_video"
    shutil.copytree(folders["qwen2_vl"], folder)
    video = {"video_processor_type": "Qwen2VLVideoProcessor", "patch_size": 14, "merge_size": 2,
             "temporal_patch_size": 2, "min_pixels": 3136, "max_pixels": 409600}
    settings = json.loads((folder / "processor_config.json").read_text())
    (folder / "processor_config.json").write_text(json.dumps({**settings, "video_processor": video}))
    (folder / "video_preprocessor_config.json").write_text(json.dumps(video))
    worker = Worker(monkeypatch, tmp_path, MODEL_NAME=str(folder), DTYPE="float32")
    reference = Reference(folders["qwen2_vl"])
    a = picture(51)
    out = worker.job(chat_job(with_images(ONE, {"A": data_url(a)})))
    assert (out["prompt_token_ids"], out["choices"][0]["token_ids"]) == reference.tokens(as_reference(ONE), [a])


@pytest.mark.slow
def test_an_image_is_encoded_on_a_thread_that_ends_with_it(folders, monkeypatch, tmp_path):
    """The encoder's torch work runs beside the engine on a thread that ends with it: a thread that ran parallel
    torch work keeps an OpenMP team while it lives, and once a process holds more OpenMP threads than cores libgomp
    makes every team sleep at its barriers, which slowed the engine's steps up to 2x after a first image request
    (a pooled asyncio.to_thread worker kept its team for good)."""
    worker = Worker(monkeypatch, tmp_path, MODEL_NAME=str(folders["llava"]), DTYPE="float32")
    job = chat_job(with_images(ONE, {"A": data_url(picture(1))}))
    worker.job(job)
    ran: set[threading.Thread] = set()

    def note(module, args):
        if threading.current_thread().name != "engine-loop":
            ran.add(threading.current_thread())

    async def serve_and_look() -> list[threading.Thread]:
        # Looked at while the event loop (and its default executor) still runs, as in the gateway and the handler.
        handle = torch.nn.modules.module.register_module_forward_pre_hook(note)
        try:
            [part async for part in worker.router.run(job)]
        finally:
            handle.remove()
        for thread in ran:
            thread.join(timeout=5)
        return [thread.name for thread in ran if thread.is_alive()]

    alive = asyncio.run(serve_and_look())
    assert ran, "the encoder's forward ran on no thread but the engine's"
    assert alive == []
