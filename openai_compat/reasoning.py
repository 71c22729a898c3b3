"""Reasoning parsers: split a reasoning model's output into its thinking (`reasoning_content`) and its answer
(`content`), for whole outputs and for streams.

Two formats: thinking between `<think>` and `</think>` (Qwen3, DeepSeek-R1 and its distills, SmolLM3, GLM,
...; Seed-OSS, Command R7B, Hunyuan 3 and Gemma 4 with markers of their own), and gpt-oss's harmony channels
(`analysis` is thinking, `final` is the answer). The parser is named by REASONING_PARSER (vLLM's names) or
recognised from the chat template.
"""
from __future__ import annotations

from dataclasses import dataclass

from .output_scan import held_back

# Families whose thinking block has its own markers; every other name of THINK_PARSERS uses <think></think>.
THINK_MARKERS = {"seed_oss": ("<seed:think>", "</seed:think>"),
                 "command_r": ("<|START_THINKING|>", "<|END_THINKING|>"),
                 "hy3": ("<think:opensource>", "</think:opensource>"),
                 "gemma4": ("<|channel>thought", "<channel|>"),
                 "minimax_m3": ("<mm:think>", "</mm:think>"),
                 "kimi_k3": ("<|open|>think<|sep|>", "<|close|>think<|sep|>")}
THINK_PARSERS = frozenset({"deepseek_r1", "qwen3", "deepseek_v3", "glm45", "ernie45", "minimax_m2",
                           "hunyuan_a13b", "think", *THINK_MARKERS})
HARMONY_PARSERS = frozenset({"openai_gptoss", "gpt_oss", "harmony"})
ATEM_PARSERS = frozenset({"muse_glimmer"})
NAMES = THINK_PARSERS | HARMONY_PARSERS | ATEM_PARSERS


def parser_name_for(setting: str | None, chat_template: str | None) -> str | None:
    """The reasoning parser to use: the setting ("none" turns parsing off), else one recognised from the
    template. Unknown names are refused by the settings check."""
    if setting:
        return None if setting == "none" else setting
    template = chat_template or ""
    if "<|channel|>" in template and "<|message|>" in template:
        return "openai_gptoss"
    if "to=self<|message|>" in template:
        return "muse_glimmer"
    for name, (_, close) in THINK_MARKERS.items():
        if close in template:
            return name
    if "</think>" in template:
        return "think"
    return None


_SAMPLE = [{"role": "user", "content": "Hello."}, {"role": "assistant", "content": "Hello!"},
           {"role": "user", "content": "Thanks."}]


def recognise(setting: str | None, chat_template: str | None, render=None) -> str | None:
    """parser_name_for, looking for the markers also in a conversation the template renders (`render`: messages
    -> prompt text), since some templates build their markers in pieces (Hunyuan 3)."""
    seen = chat_template or ""
    if not setting and render is not None:
        try:
            seen += render(_SAMPLE, add_generation_prompt=True)
        except Exception:  # a template that cannot render this is judged by its text alone
            pass
    return parser_name_for(setting, seen)


@dataclass
class Split:
    reasoning: str | None
    content: str


class ReasoningParser:
    """Incremental: `feed` the output text as it grows; `split` returns the thinking and the answer so far.
    Both only grow as more text comes, which makes streamed deltas add up to the whole response."""

    # Literal markers the parser looks for; text that may be the start of one is held back while streaming.
    markers: tuple[str, ...] = ()
    needs_special_tokens = False

    def split(self, text: str, final: bool) -> Split:
        raise NotImplementedError

    def answer_gate(self) -> tuple[str | None, str, bool]:
        """(opener, closer, starts inside): where structured output and tool calls begin. The answer begins
        after `closer`; with `opener`, the model may open a thinking block as its first token."""
        raise NotImplementedError


class ThinkParser(ReasoningParser):
    OPEN, CLOSE = "<think>", "</think>"

    def __init__(self, prompt_text: str, markers: tuple[str, str] | None = None):
        if markers is not None:
            self.OPEN, self.CLOSE = markers
        self.markers = (self.OPEN, self.CLOSE)
        # Templates that open the thinking block themselves (DeepSeek-R1, Qwen3 thinking models) leave the
        # model inside it at the first generated token.
        self.starts_inside = prompt_text.rstrip().endswith(self.OPEN)

    def split(self, text: str, final: bool) -> Split:
        inside = self.starts_inside
        body = text
        if not inside:
            stripped = text.lstrip()
            if stripped.startswith(self.OPEN):
                inside, body = True, stripped[len(self.OPEN):]
            elif stripped.startswith(self.CLOSE):  # an empty thought, as MiniMax-M3 writes one
                return Split("", stripped[len(self.CLOSE):])
            elif not final and (self.OPEN.startswith(stripped) or self.CLOSE.startswith(stripped)):
                return Split(None, "")  # may still become a tag
        if not inside:
            return Split(None, text)
        end = body.find(self.CLOSE)
        if end == -1:
            keep = len(body) if final else len(body) - held_back(body, (self.CLOSE,))
            return Split(body[:keep], "")
        return Split(body[:end], body[end + len(self.CLOSE):])

    def answer_gate(self) -> tuple[str | None, str, bool]:
        return self.OPEN, self.CLOSE, self.starts_inside


class KimiK3Parser(ThinkParser):
    """Kimi-K3: the thought in `<|open|>think<|sep|>...<|close|>think<|sep|>`, then the answer in
    `<|open|>response<|sep|>...<|close|>response<|sep|>`, then any tool calls. The content is the answer without
    its tags, followed by whatever comes after them (the calls, for the tool parser)."""
    needs_special_tokens = True
    RESPONSE = ("<|open|>response<|sep|>", "<|close|>response<|sep|>")

    def __init__(self, prompt_text: str):
        super().__init__(prompt_text, THINK_MARKERS["kimi_k3"])
        self.markers = (*self.markers, *self.RESPONSE)

    def split(self, text: str, final: bool) -> Split:
        split = super().split(text, final)
        opener, closer = self.RESPONSE
        content = split.content
        stripped = content.lstrip()
        if not stripped.startswith(opener):
            if not final and stripped and opener.startswith(stripped):
                return Split(split.reasoning, "")  # may still become the answer's tag
            return split
        body = stripped[len(opener):]
        end = body.find(closer)
        if end == -1:
            keep = len(body) if final else len(body) - held_back(body, (closer,))
            return Split(split.reasoning, body[:keep])
        return Split(split.reasoning, body[:end] + body[end + len(closer):])


class MessagesParser(ReasoningParser):
    """A reply written as messages, `<|start|>HEADER<|message|>BODY` and one of `ENDS` (gpt-oss's harmony, Muse
    Glimmer's ATEM). The generation prompt writes the first `<|start|>` and role; `route` says where each message
    goes. The markers are special tokens, so the output is decoded with them."""
    needs_special_tokens = True
    START, MESSAGE = "<|start|>", "<|message|>"
    ENDS: tuple[str, ...] = ()

    @property
    def markers(self) -> tuple[str, ...]:  # type: ignore[override]
        return (self.START, self.MESSAGE, *self.ENDS)

    def route(self, header: str, body: str, end: str) -> tuple[bool, str]:
        """(whether the message is thinking, the text it adds to the thinking or to the content)."""
        raise NotImplementedError

    def split(self, text: str, final: bool) -> Split:
        reasoning: list[str] = []
        content: list[str] = []
        at = 0
        while at < len(text):
            if text.startswith(self.START, at):
                at += len(self.START)
            header_end = text.find(self.MESSAGE, at)
            if header_end == -1:
                break  # the header is still being written
            header = text[at:header_end]
            body_start = header_end + len(self.MESSAGE)
            found = [(i, e) for e in self.ENDS if (i := text.find(e, body_start)) != -1]
            end, marker = min(found) if found else (len(text), "")
            body = text[body_start:end]
            if not found and not final:
                body = body[:len(body) - held_back(body, self.markers)]
            thinking, part = self.route(header, body, marker)
            (reasoning if thinking else content).append(part)
            if not found:
                break
            at = end + len(marker)
        return Split("".join(reasoning) if reasoning else None, "".join(content))


class HarmonyParser(MessagesParser):
    """gpt-oss: `<|channel|>analysis<|message|>...<|end|><|start|>assistant<|channel|>final<|message|>...`. A
    message addressed to a function (`to=functions.NAME` in its header) is a tool call: it goes to the content
    whole, from `<|start|>` to its end, for the `openai` tool parser to read."""
    CHANNEL = "<|channel|>"
    ENDS = ("<|end|>", "<|return|>", "<|call|>")

    @property
    def markers(self) -> tuple[str, ...]:  # type: ignore[override]
        return (self.START, self.CHANNEL, self.MESSAGE, *self.ENDS)

    def route(self, header, body, end):
        if "to=functions." in header:
            return False, f"{self.START}{header}{self.MESSAGE}{body}{end}"
        words = header.split(self.CHANNEL, 1)[1].split() if self.CHANNEL in header else []
        return words[:1] != ["final"], body

    def answer_gate(self) -> tuple[str | None, str, bool]:
        return None, f"{self.CHANNEL}final{self.MESSAGE}", True


class AtemParser(MessagesParser):
    """Muse Glimmer (ATEM): `<|start|>assistant to=RECIPIENT<|message|>...<|eom|>` (or `<|eot|>`, which ends the
    turn). To `self`: thinking; to `user` (or no one): the answer; to a tool: a call, whose body goes to the
    content whole for the `muse_glimmer` tool parser."""
    ENDS = ("<|eom|>", "<|eot|>")

    def route(self, header, body, end):
        recipient = header.split("to=", 1)[1].split()[0] if "to=" in header else "user"
        return recipient == "self", body

    def answer_gate(self) -> tuple[str | None, str, bool]:
        return None, f" to=user{self.MESSAGE}", True


def make_parser(name: str, prompt_text: str) -> ReasoningParser:
    if name in HARMONY_PARSERS:
        return HarmonyParser()
    if name in ATEM_PARSERS:
        return AtemParser()
    if name == "kimi_k3":
        return KimiK3Parser(prompt_text)
    return ThinkParser(prompt_text, THINK_MARKERS.get(name))
