"""Engine token stream -> client text stream, one response per engine message.

Role: for each engine message, take the text the engine detokenized (its text_delta), apply
stop strings (the shared rules, `kvfleet.text.output_rules.StopStringFilter`) and build the
router's response; the engine's last message becomes the router's last message
(finish_reason, usage, num_cached_tokens, engine_id). No call leaves the router per token: a
tokenizer service outage never disturbs a stream in flight.

Invariants:
- The first response carries the request id; the last one carries finish_reason.
- A stop string ends the stream at once: the engine request is aborted (its blocks freed)
  and the client gets finish_reason "stop" with `stop_reason.stop_string`. Text after the
  stop string never reaches the client, and neither do tokens after the one that completed
  it: token_ids, logprobs and usage end at that token (vLLM), even when an engine message
  carries several tokens (speculative decoding; its `token_text_ends` split the text by
  token, so matching goes token by token as with one-token messages).
- Stop strings are only checked once `min_tokens` tokens exist (vLLM's semantics), counted
  token by token.
- The EOS or stop token that ends generation is in token_ids but not in the text, unless
  include_stop_str_in_output (vLLM; the engine leaves it out of its text_delta).
- An engine stream that ends without a final message is an error (UNAVAILABLE), never a
  silently truncated answer.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Sequence

from kvfleet.contracts.errors import UnavailableError
from kvfleet.text.output_rules import StopStringFilter
from kvfleet.text.stop_strings import StopStringMatcher
from kvfleet.v1 import common_pb2, engine_pb2, router_pb2
from router.engines.dispatch import EngineStream


class ResponseRelay:
    def __init__(
        self,
        request_id: str,
        engine_request_id: str,
        prompt_ids: Sequence[int],
        min_tokens: int,
        stream: EngineStream,
        matcher: StopStringMatcher,
    ) -> None:
        self._request_id = request_id
        self._engine_request_id = engine_request_id
        self._prompt_ids = list(prompt_ids)
        self._num_prompt_tokens = len(prompt_ids)
        self._stream = stream
        self._filter = StopStringFilter(matcher, min_tokens)

    async def responses(self) -> AsyncGenerator[router_pb2.RouterGenerateResponse, None]:
        first = True
        while (message := await self._stream.read()) is not None:
            response = await self._convert(message)
            if first:
                response.request_id = self._request_id
                first = False
            yield response
            if response.HasField("finish_reason"):
                return
        raise UnavailableError(
            f"engine {self._stream.engine.engine_id} ended the stream without finishing"
        )

    async def _convert(
        self, message: engine_pb2.GenerateResponse
    ) -> router_pb2.RouterGenerateResponse:
        final = message.HasField("finish_reason")
        kept = self._filter.add(
            message.text_delta, message.token_text_ends, len(message.token_ids), final
        )
        num_kept = kept.num_kept
        response = router_pb2.RouterGenerateResponse(
            token_ids=message.token_ids[:num_kept], logprobs=message.logprobs[:num_kept]
        )
        if message.prompt_logprobs:
            response.prompt_token_ids.extend(self._prompt_ids)
            response.prompt_logprobs.extend(message.prompt_logprobs)
            response.first_prompt_token_text = message.first_prompt_token_text
        if (stop_string := self._filter.stop_string) is not None:
            last = message if final else await self._stream.abort(self._engine_request_id)
            self._finish_on_stop_string(response, last, stop_string)
        elif final:
            _copy_final(response, message, self._stream.engine.engine_id)
        response.text_delta = kept.text
        return response

    def _finish_on_stop_string(
        self,
        response: router_pb2.RouterGenerateResponse,
        last: engine_pb2.GenerateResponse | None,
        stop_string: str,
    ) -> None:
        response.finish_reason = "stop"
        response.stop_reason.stop_string = stop_string
        response.usage.CopyFrom(
            common_pb2.Usage(
                prompt_tokens=self._num_prompt_tokens,
                completion_tokens=self._filter.num_tokens,
                total_tokens=self._num_prompt_tokens + self._filter.num_tokens,
            )
        )
        response.engine_id = self._stream.engine.engine_id
        if last is not None:
            response.num_cached_tokens = last.num_cached_tokens


def _copy_final(
    response: router_pb2.RouterGenerateResponse,
    message: engine_pb2.GenerateResponse,
    engine_id: str,
) -> None:
    response.finish_reason = message.finish_reason
    if message.HasField("stop_reason"):
        response.stop_reason.CopyFrom(message.stop_reason)
    response.usage.CopyFrom(message.usage)
    response.num_cached_tokens = message.num_cached_tokens
    response.engine_id = message.engine_id or engine_id
