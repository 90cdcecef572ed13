"""The prefill side of a handoff: run a request to its first token, then push its KV.

Role: `PrefillRun` drives one Prefill RPC: the request runs prefill-only (chunked, with the
engine's prefix cache); its first token goes out at once; if that token did not end the
request (finish_reason "handoff"), the exported KV goes to the decode engine through the
connector, and the last message says what was sent.

Invariants:
- The first message never flushes held-back text: the decode engine's stream continues the
  same incremental detokenization after the first token.
- By the time the first token is out the engine has freed the request (its full blocks stay
  in its prefix cache); only the CPU copy of its KV lives on until the push ends. That
  memory serves a later export only if the push succeeded (a shared-memory segment of a
  failed one may still be read: it is dropped).
- A failed push raises (UNAVAILABLE to the router) after the first token went out; the
  router then falls back to a decode engine that recomputes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Callable

from engine.disagg.kv_payload import KVExport
from engine.disagg.metrics import TransferMetrics
from engine.disagg.transfer import KVConnector, KVTransfer
from engine.service.engine_state import GenerateOutput
from engine.service.output_text import StreamText
from kvfleet.contracts.errors import UnavailableError
from kvfleet.text.output_rules import TextDelta
from kvfleet.v1 import engine_pb2

DEFAULT_TRANSFER_TIMEOUT_S = 30.0
Respond = Callable[[GenerateOutput, TextDelta], engine_pb2.GenerateResponse]


async def prefill_responses(
    request: engine_pb2.PrefillRequest,
    outputs: AsyncIterator[GenerateOutput],
    text: StreamText,
    respond: Respond,
    connector: KVConnector,
    metrics: TransferMetrics | None,
) -> AsyncIterator[engine_pb2.PrefillResponse]:
    final: GenerateOutput | None = None
    async for output in outputs:
        if output.finished:
            final = output
            break
        # A keep-alive (queued, long chunked prefill): pass it on.
        yield engine_pb2.PrefillResponse(output=respond(output, text.delta(output)))
    if final is None:
        raise UnavailableError("the prefill ended without a first token")
    export = final.kv_export
    if final.finish_reason != "handoff":  # the first token ended it: a whole answer
        yield engine_pb2.PrefillResponse(output=respond(final, text.delta(final)))
        return
    assert isinstance(export, KVExport)
    sent = False
    try:
        async for response in _hand_off(request, final, export, text, respond, connector,
                                        metrics):
            sent = sent or response.HasField("transfer")  # the receiver has every block
            yield response
    finally:  # nothing reads the export after its push (or the call) ended; after a failed
        # push a receiver may still read its segment, which must not serve another export
        if export.release is not None:
            export.release(sent)


async def _hand_off(
    request: engine_pb2.PrefillRequest, final: GenerateOutput, export: KVExport,
    text: StreamText, respond: Respond, connector: KVConnector,
    metrics: TransferMetrics | None,
) -> AsyncIterator[engine_pb2.PrefillResponse]:
    going_on = dataclasses.replace(final, finished=False, finish_reason=None, kv_export=None)
    first = respond(going_on, text.delta(going_on))
    # Known only here: the router reports it on the decode engine's last message.
    first.num_cached_tokens = final.num_cached_tokens
    yield engine_pb2.PrefillResponse(output=first)
    timeout_s = request.transfer_timeout_s or DEFAULT_TRANSFER_TIMEOUT_S
    transfer = KVTransfer(request.transfer_id, request.request, export,
                          request.decode_address, timeout_s, request.skip_blocks)
    try:
        result = await connector.send(transfer)
    except Exception as exc:
        if metrics is not None:
            metrics.failed("send")
        raise UnavailableError(
            f"KV transfer {request.transfer_id} to {request.decode_address} failed: {exc}"
        ) from exc
    if metrics is not None:
        metrics.sent(result.num_bytes, result.seconds, result.num_blocks, result.transport)
    yield engine_pb2.PrefillResponse(transfer=result)
