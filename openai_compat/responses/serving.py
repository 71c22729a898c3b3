"""`/v1/responses` on the chat path.

A Responses request becomes a ChatCompletionRequest (instructions as the first system message, input items as
chat messages, tools, tool_choice, text.format, reasoning.effort and the sampling fields mapped to chat's) and
runs through `ChatServing.generate`: the same template, tool-call and reasoning parsers, grammars and batching as
chat. Each reply is shaped into output items: the thinking as a `reasoning` item (when a reasoning parser
applies), the answer as a `message`, each tool call as a `function_call`; a stream as the Responses API's typed
events. Errors name the Responses parameter (`max_output_tokens`, `text.format`, `tools[0].parameters`), not the
chat one it was mapped to.

`store` (default true, as OpenAI's) keeps the response and its conversation in this worker's store (store.py),
for `GET /v1/responses/{id}` and `previous_response_id`.
"""
from __future__ import annotations

import asyncio
import re
import time
import uuid
from typing import Any

from ..chat.generation import ChatGeneration, ChoiceDelta, ChoiceResult
from ..chat.protocol import ChatCompletionRequest
from ..chat.serving import ChatServing
from ..errors import OpenAIError
from ..protocol import ChatTokenLogprob
from ..streaming import EventStream
from ..validation import parse
from .protocol import (ArgumentsDeltaEvent, ArgumentsDoneEvent, ContentPart, ContentPartEvent, ErrorEvent,
                       FunctionCallItem, FunctionCallOutputItem, InputItem, InputTokensDetails, LifecycleEvent,
                       MessageItem, OutputFunctionCall, OutputItem, OutputItemEvent, OutputMessage, OutputReasoning,
                       OutputText, OutputTokensDetails, ReasoningDeltaEvent, ReasoningDoneEvent, ReasoningItem,
                       ReasoningText, ResponseEvent, ResponseObject, ResponsesRequest, ResponseUsage, TextDeltaEvent,
                       TextDoneEvent, ToolChoiceFunction)
from .store import ResponseStore, StoredResponse

# The sampling fields a Responses request shares with chat, passed on as they are.
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                   "frequency_penalty", "seed", "stop", "stop_token_ids", "min_tokens", "ignore_eos",
                   "include_stop_str_in_output", "skip_special_tokens", "logit_bias")


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _call_id(chat_id: str | None) -> str:
    """A call's `call_id`: chat's generated ids in OpenAI's Responses spelling; a model's own ids as they are."""
    if not chat_id:
        return _new_id("call")
    return "call_" + chat_id.removeprefix("chatcmpl-tool-") if chat_id.startswith("chatcmpl-tool-") else chat_id


# ---------------------------------------------------------------- the request as a chat request


def image_paths(items: list[InputItem], first_input: int = 0) -> list[str]:
    """Where each input_image part is in the request (in order), for errors about it: `input[i].content[j]`, or
    the stored response an earlier item came from."""
    return [f"input[{index - first_input}].content[{j}]" if index >= first_input else "previous_response_id"
            for index, item in enumerate(items) if isinstance(item, MessageItem) and item.has_images
            for j, part in enumerate(item.content) if part.type == "input_image"]


def chat_messages(instructions: str | None, items: list[InputItem], first_input: int = 0) -> list[dict[str, Any]]:
    """The conversation as chat messages. Consecutive function calls (and an assistant message just before
    them) make one assistant message with tool calls; a function call's output is a tool message; a reasoning
    item's text becomes the next assistant message's `reasoning_content` (the template renders or drops it, as
    it does chat's), and is dropped when no assistant message follows it. `first_input` is the index of the
    request's own first item in `items` (earlier ones come from a stored response), for error paths."""
    messages: list[dict[str, Any]] = []
    if instructions is not None:
        messages.append({"role": "system", "content": instructions})
    call_ids: set[str] = set()
    reasoning: list[str] = []

    def assistant(message: dict[str, Any]) -> dict[str, Any]:
        if reasoning:
            message["reasoning_content"] = "\n".join(reasoning)
            reasoning.clear()
        messages.append(message)
        return message

    for index, item in enumerate(items):
        if isinstance(item, ReasoningItem):
            if item.text:
                reasoning.append(item.text)
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            call_ids.add(item.call_id)
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and not reasoning:
                last.setdefault("tool_calls", []).append(call)
            else:
                assistant({"role": "assistant", "content": None, "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutputItem):
            if item.call_id not in call_ids:
                where = f"input[{index - first_input}].call_id"
                raise OpenAIError(f"{where}: no function_call item with call_id {item.call_id!r} comes before this "
                                  f"output", param=where)
            reasoning.clear()
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text})
        elif item.role == "assistant":
            assistant({"role": "assistant", "content": item.chat_parts() if item.has_images else item.text})
        else:
            reasoning.clear()
            messages.append({"role": item.role, "content": item.chat_parts() if item.has_images else item.text})
    if not messages:
        raise OpenAIError("the input is empty: give at least one input item or instructions", param="input")
    return messages


def chat_body(request: ResponsesRequest, messages: list[dict[str, Any]]) -> dict[str, Any]:
    """The chat completion request a Responses request maps to."""
    body: dict[str, Any] = {"messages": messages, "model": request.model,
                            "max_completion_tokens": request.max_output_tokens}
    body.update((name, getattr(request, name)) for name in SAMPLING_FIELDS)
    if request.tools:
        body["tools"] = [{"type": "function", "function": tool.model_dump(exclude={"type"}, exclude_none=True)}
                         for tool in request.tools]
    choice = request.tool_choice
    body["tool_choice"] = ({"type": "function", "function": {"name": choice.name}}
                           if isinstance(choice, ToolChoiceFunction) else choice)
    body["parallel_tool_calls"] = request.parallel_tool_calls
    fmt = request.text.format if request.text is not None else None
    if fmt is not None and fmt.type == "json_object":
        body["response_format"] = {"type": "json_object"}
    elif fmt is not None and fmt.type == "json_schema":
        schema = {"name": fmt.name, "description": fmt.description, "schema": fmt.schema_, "strict": fmt.strict}
        body["response_format"] = {"type": "json_schema",
                                   "json_schema": {k: v for k, v in schema.items() if v is not None}}
    if request.structured_outputs is not None:
        body["structured_outputs"] = request.structured_outputs.model_dump(by_alias=True, exclude_none=True)
    kwargs = dict(request.chat_template_kwargs or {})
    if request.reasoning is not None and request.reasoning.effort is not None:
        kwargs["reasoning_effort"] = request.reasoning.effort  # as vLLM hands chat's reasoning_effort over
    if kwargs:
        body["chat_template_kwargs"] = kwargs
    if request.wants_logprobs:
        body["logprobs"] = True
        body["top_logprobs"] = request.top_logprobs or 0
    return {name: value for name, value in body.items() if value is not None}


def responses_error(exc: OpenAIError) -> OpenAIError:
    """A chat error in the terms of the Responses request it came from."""
    param = exc.param
    if param is not None:
        if param.startswith("messages"):
            param = "input"
        elif param == "max_completion_tokens":
            param = "max_output_tokens"
        elif param.startswith("response_format"):
            param = "text.format"
        elif param == "logprobs":
            param = "include"
        param = re.sub(r"^tools\[(\d+)\]\.function\b", r"tools[\1]", param)
    message = re.sub(r"tools\[(\d+)\]\.function\b", r"tools[\1]", exc.message)
    message = re.sub(r"\bmessages(\[\d+\]|\.\w+)*:", "input:", message)  # the conversation is the input
    message = message.replace("max_completion_tokens", "max_output_tokens").replace("response_format",
                                                                                    "text.format")
    return OpenAIError(message, exc.status, param, exc.type)


# ---------------------------------------------------------------- serving


class ResponsesServing:
    def __init__(self, chat: ChatServing, store: ResponseStore | None = None):
        self.chat = chat
        self.serving = chat.serving
        self.store = store if store is not None else ResponseStore()

    def retrieve(self, response_id: str) -> dict[str, Any]:
        stored = self.store.get(response_id)
        if stored is None:
            raise OpenAIError(f"No response with id {ascii(response_id)[:100]} is stored on this worker. Stored "
                              f"responses live only in the memory of the worker that made them (each serverless "
                              f"worker has its own, lost when it stops), and only while the store keeps them.",
                              status=404, param="response_id")
        return stored.response

    async def create_response(self, request: ResponsesRequest) -> ResponseObject | EventStream:
        prior: list[InputItem] = []
        prior_size = 0
        if request.previous_response_id is not None:
            stored = self.store.get(request.previous_response_id)
            if stored is None:
                raise OpenAIError(
                    f"previous_response_id {ascii(request.previous_response_id)[:100]} is not stored on this "
                    f"worker: stored responses live only in the memory of the worker that made them, and a "
                    f"serverless endpoint may send each request to another worker. Send the whole conversation in "
                    f"input instead (and store: false if you do not need to retrieve it).",
                    param="previous_response_id")
            prior, prior_size = stored.conversation, stored.size
        items = [*prior, *request.input_items]
        await self.serving.ready_for(request.model)
        chat_request = await asyncio.to_thread(self._chat_request, request, items, len(prior))
        try:
            generation = await self.chat.generate(chat_request, endpoint="the Responses API", id_prefix="resp",
                                                  image_paths=image_paths(items, len(prior)))
        except OpenAIError as exc:
            raise responses_error(exc) from None
        run = _Run(self, request, generation, items, prior_size)
        if request.stream:
            stream = _Stream(run)
            return EventStream(stream.events(), _counts, stream.error_event)
        return await run.whole()

    def _chat_request(self, request: ResponsesRequest, items: list[InputItem], first_input: int
                      ) -> ChatCompletionRequest:
        messages = chat_messages(request.instructions, items, first_input)
        try:
            return parse(ChatCompletionRequest, chat_body(request, messages), self.serving.request_limits())
        except OpenAIError as exc:
            raise responses_error(exc) from None


class _Run:
    """One response being made: its id, its echo of the request, its output items and usage, and storing it."""

    def __init__(self, owner: ResponsesServing, request: ResponsesRequest, generation: ChatGeneration,
                 items: list[InputItem], prior_size: int):
        self.owner = owner
        self.request = request
        self.generation = generation
        self.items = items
        self.prior_size = prior_size
        self.id = "resp_" + generation.request_id.removeprefix("resp-")
        self.created_at = int(time.time())

    def response(self, status: str, output: list[OutputItem], finish_reason: str | None = None
                 ) -> ResponseObject:
        """The response object; usage and completion time once `finish_reason` is known."""
        request, params = self.request, self.generation.params
        usage = completed_at = incomplete = None
        if finish_reason is not None:
            completed_at = int(time.time())
            usage = self._usage(output)
            if status == "incomplete":
                incomplete = {"reason": "max_output_tokens"}
        choice = request.tool_choice
        fmt = request.text.format if request.text is not None else None
        text: dict[str, Any] = {"format": fmt.echo() if fmt is not None else {"type": "text"}}
        if request.text is not None and request.text.verbosity is not None:
            text["verbosity"] = request.text.verbosity
        return ResponseObject(
            id=self.id, created_at=self.created_at, completed_at=completed_at, status=status,
            incomplete_details=incomplete, model=self.owner.serving.served_model_name,
            instructions=request.instructions, output=output, usage=usage,
            previous_response_id=request.previous_response_id, store=request.store, metadata=request.metadata or {},
            user=request.user, max_output_tokens=request.max_output_tokens, temperature=params.temperature,
            top_p=params.top_p, top_logprobs=request.top_logprobs,
            parallel_tool_calls=request.parallel_tool_calls is not False,
            tool_choice=choice.model_dump() if isinstance(choice, ToolChoiceFunction) else choice or "auto",
            tools=[tool.model_dump() for tool in request.tools or ()], text=text,
            reasoning={"effort": request.reasoning.effort if request.reasoning else None, "summary": None})

    def _usage(self, output: list[OutputItem]) -> ResponseUsage:
        generation = self.generation
        thinking = "".join(part.text for item in output if isinstance(item, OutputReasoning) for part in item.content)
        reasoning_tokens = 0
        if thinking:
            tokens = self.owner.serving.engine.tokenizer.encode(thinking, add_special_tokens=False)
            reasoning_tokens = min(len(tokens), generation.completion_tokens)
        return ResponseUsage(
            input_tokens=generation.prompt_tokens,
            input_tokens_details=InputTokensDetails(cached_tokens=generation.cached_prompt_tokens),
            output_tokens=generation.completion_tokens,
            output_tokens_details=OutputTokensDetails(reasoning_tokens=reasoning_tokens),
            total_tokens=generation.prompt_tokens + generation.completion_tokens)

    async def whole(self) -> ResponseObject:
        (result,) = await self.generation.results()
        output = _output_items(result)
        status = "incomplete" if result.finish_reason == "length" else "completed"
        response = self.response(status, output, result.finish_reason)
        self.keep(response)
        return response

    def keep(self, response: ResponseObject) -> None:
        """Store a finished response with its conversation, when the request asked for it."""
        if not self.request.store:
            return
        output = [_as_input(item) for item in response.output]
        size = (self.prior_size + len(response.model_dump_json())
                + sum(len(item.model_dump_json()) for item in (*self.request.input_items, *output)))
        self.owner.store.put(self.id, StoredResponse(response.model_dump(mode="json"), [*self.items, *output], size))


def _output_items(result: ChoiceResult) -> list[OutputItem]:
    """A whole reply as output items: its thinking, its answer (always a message when it made no call), its
    calls. When the budget ran out, the last item is incomplete."""
    parsed = result.message
    items: list[OutputItem] = []
    if parsed.reasoning:
        items.append(OutputReasoning(id=_new_id("rs"), content=[ReasoningText(text=parsed.reasoning)],
                                     status="completed"))
    if parsed.content or not parsed.tool_calls:
        items.append(OutputMessage(id=_new_id("msg"), status="completed", content=[
            OutputText(text=parsed.content or "", logprobs=result.logprobs or [])]))
    for call in parsed.tool_calls:
        items.append(OutputFunctionCall(id=_new_id("fc"), call_id=_call_id(call.id), name=call.function.name,
                                        arguments=call.function.arguments, status="completed"))
    if result.finish_reason == "length":
        items[-1].status = "incomplete"
    return items


def _as_input(item: OutputItem) -> InputItem:
    """An output item as the input item that continues a conversation from it."""
    if isinstance(item, OutputMessage):
        return MessageItem(role="assistant", id=item.id, status=item.status,
                           content=[ContentPart(type="output_text", text=part.text) for part in item.content])
    if isinstance(item, OutputFunctionCall):
        return FunctionCallItem(type="function_call", id=item.id, call_id=item.call_id, name=item.name,
                                arguments=item.arguments, status=item.status)
    return ReasoningItem(type="reasoning", id=item.id, content=[ReasoningText(text=p.text) for p in item.content],
                         status=item.status)


# ---------------------------------------------------------------- streaming


def _counts(event: ResponseEvent) -> bool:
    """Events that count towards a job output's batch: those that carry output, and the first and last."""
    return event.type.endswith(".delta") or event.type in ("response.created", "response.completed",
                                                           "response.incomplete")


class _Stream:
    """A reply's deltas as Responses events. An item opens when its first delta comes (output_item.added, and
    content_part.added for text) and closes when an item of another kind opens or the reply ends (the .done
    events). The items add up to what `_output_items` makes of the whole reply."""

    def __init__(self, run: _Run):
        self.run = run
        self.sequence = 0
        self.output: list[OutputItem] = []
        self.open: OutputItem | None = None
        self.calls: dict[int, OutputFunctionCall] = {}  # by the chat stream's call index
        self.pending_logprobs: list[ChatTokenLogprob] = []

    def _event(self, kind: type[ResponseEvent], **fields) -> ResponseEvent:
        event = kind(sequence_number=self.sequence, **fields)
        self.sequence += 1
        return event

    def error_event(self, exc: OpenAIError) -> ErrorEvent:
        return self._event(ErrorEvent, code=str(exc.status), message=exc.message, param=exc.param)

    async def events(self):
        run = self.run
        yield self._event(LifecycleEvent, type="response.created", response=run.response("in_progress", []))
        yield self._event(LifecycleEvent, type="response.in_progress", response=run.response("in_progress", []))
        finish_reason = None
        async for step in run.generation.stream():
            for delta in step:
                for event in self._feed(delta):
                    yield event
                if delta.finish_reason is not None:
                    finish_reason = delta.finish_reason
                    for event in self._finish(finish_reason):
                        yield event
        status = "incomplete" if finish_reason == "length" else "completed"
        response = run.response(status, self.output, finish_reason or "stop")
        run.keep(response)
        yield self._event(LifecycleEvent, type=f"response.{status}", response=response)

    @property
    def _index(self) -> int:
        return len(self.output) - 1

    def _open(self, item: OutputItem) -> list[ResponseEvent]:
        events = self._close("completed")
        self.output.append(item)
        self.open = item
        events.append(self._event(OutputItemEvent, type="response.output_item.added", output_index=self._index,
                                  item=item.model_copy(deep=True)))
        part = (OutputText() if isinstance(item, OutputMessage) else ReasoningText(text="")
                if isinstance(item, OutputReasoning) else None)
        if part is not None:
            item.content.append(part)
            events.append(self._event(ContentPartEvent, type="response.content_part.added", item_id=item.id,
                                      output_index=self._index, content_index=0, part=part.model_copy(deep=True)))
        return events

    def _close(self, status: str) -> list[ResponseEvent]:
        item, self.open = self.open, None
        if item is None:
            return []
        item.status = status
        where = {"item_id": item.id, "output_index": self._index}
        events: list[ResponseEvent] = []
        if isinstance(item, OutputMessage):
            part = item.content[0]
            part.logprobs.extend(self.pending_logprobs)
            self.pending_logprobs = []
            events.append(self._event(TextDoneEvent, **where, content_index=0, text=part.text,
                                      logprobs=list(part.logprobs)))
        elif isinstance(item, OutputReasoning):
            part = item.content[0]
            events.append(self._event(ReasoningDoneEvent, **where, content_index=0, text=part.text))
        else:
            part = None
            events.append(self._event(ArgumentsDoneEvent, **where, name=item.name, arguments=item.arguments))
        if part is not None:
            events.append(self._event(ContentPartEvent, type="response.content_part.done", **where, content_index=0,
                                      part=part.model_copy(deep=True)))
        events.append(self._event(OutputItemEvent, type="response.output_item.done", output_index=self._index,
                                  item=item.model_copy(deep=True)))
        return events

    def _feed(self, delta: ChoiceDelta) -> list[ResponseEvent]:
        events: list[ResponseEvent] = []
        piece = delta.delta
        if delta.logprobs:
            self.pending_logprobs.extend(delta.logprobs)
        if piece.reasoning:
            if not isinstance(self.open, OutputReasoning):
                events += self._open(OutputReasoning(id=_new_id("rs")))
            self.open.content[0].text += piece.reasoning
            events.append(self._event(ReasoningDeltaEvent, item_id=self.open.id, output_index=self._index,
                                      content_index=0, delta=piece.reasoning))
        if piece.content:
            if not isinstance(self.open, OutputMessage):
                events += self._open(OutputMessage(id=_new_id("msg")))
            part = self.open.content[0]
            part.text += piece.content
            logprobs, self.pending_logprobs = self.pending_logprobs, []
            part.logprobs.extend(logprobs)
            events.append(self._event(TextDeltaEvent, item_id=self.open.id, output_index=self._index,
                                      content_index=0, delta=piece.content, logprobs=logprobs))
        for call in piece.tool_calls:
            item = self.calls.get(call.index)
            if item is None:  # a call's first piece: its id and name
                name = call.function.name if call.function is not None else None
                item = self.calls[call.index] = OutputFunctionCall(id=_new_id("fc"), call_id=_call_id(call.id),
                                                                   name=name or "")
                events += self._open(item)
            arguments = call.function.arguments if call.function is not None else None
            if arguments:
                item.arguments += arguments
                if item is self.open:  # (a piece for a call already closed reaches only the final response)
                    events.append(self._event(ArgumentsDeltaEvent, item_id=item.id, output_index=self._index,
                                              delta=arguments))
        return events

    def _finish(self, finish_reason: str) -> list[ResponseEvent]:
        """Close the reply: a reply without a message or a call still gets a message, as `_output_items` gives
        it; the last item is incomplete when the budget ran out."""
        status = "incomplete" if finish_reason == "length" else "completed"
        needs_message = not any(isinstance(item, (OutputMessage, OutputFunctionCall)) for item in self.output)
        events = self._close("completed" if needs_message else status)
        if needs_message:
            events += self._open(OutputMessage(id=_new_id("msg")))
            events += self._close(status)
        return events
