"""Renders one OpenAI request's router messages, whole (`body`) or as SSE chunks (`chunks`).

Role: the per-request state between the pipeline and the HTTP response: it folds every
message into `openai_format.Choices` (so streamed deltas and the whole body come from the
same text), prepends the echoed prompt, and for chat sends the assistant role first on each
choice. Logprob token strings travel in the messages (the engine decodes them): rendering
calls no service.

A chat request with a `ChatOutputPlan` (tool calls, reasoning) reads each choice's text
through its own `ChatOutputParser`: streamed, deltas carry `reasoning_content`, `content`
and `tool_calls`; whole, the message is the same parse of the choice's full text
(`router.openai.chat_output`).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvfleet.v1 import router_pb2
from router.openai.chat_output import ChatOutputParser, ChatOutputPlan, stream_delta, whole_message
from router.openai.render import (
    Choice,
    Choices,
    Json,
    chat_chunk,
    completion_chunk,
    usage_chunk,
)

Tagged = tuple[int, router_pb2.RouterGenerateResponse]


class StreamRenderer:
    def __init__(
        self,
        choices: Choices,
        response_id: str,
        created: int,
        model: str,
        echo: Sequence[str] = (),
        plan: ChatOutputPlan | None = None,
    ) -> None:
        self.choices = choices
        self.response_id = response_id
        self.created = created
        self.model = model
        self._echo = list(echo)
        self._plan = plan
        self._parsers: dict[int, ChatOutputParser] = {}

    async def fold(self, item: Tagged) -> None:
        await self._add(item)

    async def chunks(self, item: Tagged) -> list[Json]:
        prompt_index, response = item
        is_new = self._index(item) not in self.choices.choices
        choice, text, logprobs = await self._add(item)
        final = response.HasField("finish_reason")
        if not (text or logprobs or final or is_new):
            return []
        ident = (self.response_id, self.model, self.created)
        if self.choices.kind == "completion":
            return [completion_chunk(*ident, choice, text, logprobs, final)]
        out = []
        if is_new:
            out.append(chat_chunk(*ident, choice, {"role": "assistant", "content": ""},
                                  None, False))
        if self._plan is not None:
            delta = self._parsed_delta(choice, text, final)
            if delta or logprobs or final:
                out.append(chat_chunk(*ident, choice, delta, logprobs, final))
        elif text or logprobs or final:
            out.append(chat_chunk(*ident, choice, {"content": text}, logprobs, final))
        return out

    def body(self) -> Json:
        if self.choices.kind == "completion":
            return self.choices.completion_body(self.response_id, self.model, self.created)
        body = self.choices.chat_body(self.response_id, self.model, self.created)
        if self._plan is not None:
            for rendered, choice in zip(body["choices"], self.choices.sorted(), strict=True):
                message, called = whole_message(self._plan, choice.text)
                rendered["message"] = message
                rendered["finish_reason"] = self._plan.finish_reason(choice.finish_reason, called)
        return body

    def _parsed_delta(self, choice: Choice, text: str, final: bool) -> Json:
        """The choice's next delta through its parser; on its last message the parser's
        held-back rest too, and the finish reason it implies."""
        assert self._plan is not None
        parser = self._parsers.setdefault(choice.index, self._plan.new_parser())
        delta = parser.feed(text)
        if final:
            delta.extend(parser.finish())
            choice.finish_reason = self._plan.finish_reason(choice.finish_reason, parser.called)
        return stream_delta(delta)

    def usage_chunk(self) -> Json:
        obj = "text_completion" if self.choices.kind == "completion" else "chat.completion.chunk"
        return usage_chunk(self.response_id, self.model, self.created, obj, self.choices.usage())

    def _index(self, item: Tagged) -> int:
        return item[0] * self.choices.n + item[1].index

    async def _add(self, item: Tagged) -> tuple[Choice, str, Json | list[Json] | None]:
        prompt_index, response = item
        prefix = ""
        if self._echo and self._index(item) not in self.choices.choices:
            prefix = self._echo[prompt_index]
        choice, logprobs = self.choices.add(prompt_index, response, prefix)
        return choice, prefix + response.text_delta, logprobs
