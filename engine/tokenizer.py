"""Text <-> tokens for the served model: encoding, chat templates, decoding."""
from __future__ import annotations

from typing import Any

from engine.core.detokenizer import IncrementalDetokenizer


class ChatTemplateError(ValueError):
    """The conversation cannot be rendered (no template, or the template rejected it)."""


class Tokenizer:
    def __init__(self, hf_tokenizer, chat_template: str | None, eos_token_ids: frozenset[int], vocab_size: int):
        self.hf = hf_tokenizer
        self.chat_template = chat_template or getattr(hf_tokenizer, "chat_template", None) or None
        self.eos_token_ids = eos_token_ids
        # Ids the model can take (embedding rows) and the tokenizer can turn back into text.
        self.vocab_size = min(vocab_size, len(hf_tokenizer))
        # No token stands for more input characters than its own spelling in the vocabulary has (byte-level
        # BPE spells each byte as one character, SentencePiece spells its pieces out), so a text longer than
        # n * max_token_chars has more than n tokens. That lets an oversized prompt be refused without
        # tokenizing megabytes. (A normalizer that deletes input characters would break this; the tokenizers
        # of causal LMs keep every character.)
        self.max_token_chars = max((len(token) for token in hf_tokenizer.get_vocab()), default=1) or 1

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def encode_pair(self, text: str, pair: str) -> tuple[list[int], list[int] | None]:
        """A text pair as a cross-encoder takes it (with the tokenizer's separators), and the segment ids when
        the model uses them."""
        encoded = self.hf(text, pair, add_special_tokens=True)
        types = encoded.get("token_type_ids")
        return list(encoded["input_ids"]), list(types) if types is not None else None

    def token_strings(self, ids: list[int]) -> list[str]:
        """The vocabulary's spelling of each token (byte-level pieces as stored, e.g. 'Ġworld')."""
        return list(self.hf.convert_ids_to_tokens(ids))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False)

    def token_text(self, token_id: int) -> str:
        """A single token as text, the way OpenAI logprobs show it."""
        return self.hf.decode([token_id], skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def token_id(self, token: str) -> int | None:
        """The id of a token spelled exactly (special tokens such as FIM markers), or None."""
        ids = self.hf.convert_tokens_to_ids([token])
        unk = getattr(self.hf, "unk_token_id", None)
        return ids[0] if ids and ids[0] is not None and ids[0] != unk else None

    def special_token_id(self, token: str) -> int | None:
        """The id of `token` when the tokenizer has it as one special token (grammars name those by id), or None."""
        token_id = self.token_id(token)
        added = getattr(self.hf, "added_tokens_decoder", {}).get(token_id) if token_id is not None else None
        return token_id if added is not None and added.special else None

    def special_tokens(self) -> dict[str, int]:
        """Every special token by its text (grammars name them by id: text tokens never spell one out)."""
        if getattr(self, "_special_tokens", None) is None:
            decoder = getattr(self.hf, "added_tokens_decoder", {}) or {}
            self._special_tokens = {added.content: token_id for token_id, added in decoder.items() if added.special}
        return self._special_tokens

    def detokenizer(self, prompt_ids: list[int], skip_special_tokens: bool,
                    spaces_between_special_tokens: bool = True) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self.hf, prompt_ids, skip_special_tokens, spaces_between_special_tokens)

    @property
    def has_chat_template(self) -> bool:
        return self.chat_template is not None

    def render_chat(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True,
                    continue_final_message: bool = False, tools: list[dict] | None = None,
                    documents: list[dict] | None = None, template_kwargs: dict[str, Any] | None = None) -> str:
        """The prompt text for a conversation. Templates run in transformers' sandboxed Jinja environment;
        message content is passed as data and never evaluated as template code."""
        if self.chat_template is None:
            raise ChatTemplateError("this model has no chat template; set CUSTOM_CHAT_TEMPLATE or use "
                                    "/v1/completions")
        # Extra template variables never override the explicit arguments (vLLM merges them the same way), and
        # cannot replace the template or make it tokenize.
        kwargs = {k: v for k, v in (template_kwargs or {}).items() if k != "conversation"}
        explicit = dict(tools=tools, documents=documents, chat_template=self.chat_template,
                        add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
                        tokenize=False, return_dict=False)
        kwargs.update((k, v) for k, v in explicit.items() if v is not None)
        try:
            return self.hf.apply_chat_template(messages, **kwargs)
        except Exception as exc:  # jinja errors, raise_exception() in templates, bad final message
            raise ChatTemplateError(f"chat template failed: {exc}") from exc
