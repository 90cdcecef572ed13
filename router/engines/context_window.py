"""The served model's context length (max_model_len), as the chosen engine reports it.

Role: lets the router refuse a prompt that cannot fit before sending it anywhere, with an
error naming the field (vLLM's wording), and document what "max_tokens unset" means: up to
max_model_len - prompt tokens of the engine that serves the request.

Invariants:
- The figure is the engine's own (its --max-model-len, not the model config's). An engine
  publishes it in its registry record, which the routing decision already read
  (`EngineView.max_model_len`): `published` takes it from there, with no wait between the
  decision and the send. Only for an engine that did not publish it (an older engine) is it
  asked over gRPC (`GetLoad().max_model_len`, `fetch`), cached per (engine id, address) for
  `ttl_s`; concurrent requests share one GetLoad, and an engine that did not answer is not
  asked again for `retry_s`. A GetLoad on the request path waits for a busy engine (up to
  `timeout_s`) while the decision's reservation holds that engine for everyone else.
- Best effort: when an engine does not answer in time the check is skipped. The engine
  validates every request itself, so the router's check only makes the error earlier and
  clearer; it never admits what the engine would refuse.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import grpc
import grpc.aio

from kvfleet.contracts.errors import InvalidFieldError
from kvfleet.v1 import engine_pb2
from router.engines.pool import EnginePool
from router.routing.ranking import EngineView

logger = logging.getLogger(__name__)

DEFAULT_TTL_S = 30.0
DEFAULT_TIMEOUT_S = 0.5
DEFAULT_RETRY_S = 5.0


class ContextWindows:
    def __init__(
        self,
        pool: EnginePool,
        ttl_s: float = DEFAULT_TTL_S,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        retry_s: float = DEFAULT_RETRY_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._pool = pool
        self._ttl_s = ttl_s
        self._timeout_s = timeout_s
        self._retry_s = retry_s
        self._clock = clock
        self._known: dict[tuple[str, str], tuple[float, int | None]] = {}
        self._pending: dict[tuple[str, str], asyncio.Future[int | None]] = {}

    def published(self, engine: EngineView) -> int | None:
        """The max_model_len the engine published with its load (None: it did not); it
        counts for `largest_known` like an answered GetLoad."""
        if engine.max_model_len <= 0:
            return None
        key = (engine.engine_id, engine.address)
        known = self._known.get(key)
        now = self._clock()
        # Refreshed at most every ttl_s / 2: this runs once per request.
        if known is None or known[1] != engine.max_model_len or known[0] - now < self._ttl_s / 2:
            self._known[key] = (now + self._ttl_s, engine.max_model_len)
        return engine.max_model_len

    async def fetch(self, engine: EngineView) -> int | None:
        """The engine's GetLoad answer (cached), or None when it did not say in time."""
        key = (engine.engine_id, engine.address)
        known = self._known.get(key)
        if known is not None and known[0] > self._clock():
            return known[1]
        pending = self._pending.get(key)
        if pending is None:
            pending = asyncio.ensure_future(self._fetch(engine))
            self._pending[key] = pending
            pending.add_done_callback(lambda _: self._pending.pop(key, None))
        return await asyncio.shield(pending)

    def largest_known(self) -> int | None:
        """The largest max_model_len a live engine reported: no prompt longer than it fits
        anywhere, so it can be refused before routing (None until an engine reported)."""
        now = self._clock()
        known = [value for expires, value in self._known.values()
                 if value is not None and expires > now]
        return max(known, default=None)

    async def _fetch(self, engine: EngineView) -> int | None:
        stub = self._pool.stub(engine.engine_id, engine.address)
        value: int | None = None
        try:
            load = await stub.GetLoad(engine_pb2.GetLoadRequest(), timeout=self._timeout_s)
            value = int(load.max_model_len) or None
        except grpc.aio.AioRpcError as e:
            logger.debug("GetLoad of %s for its max_model_len: %s", engine.engine_id, e.code())
        expires = self._clock() + (self._ttl_s if value is not None else self._retry_s)
        self._known[(engine.engine_id, engine.address)] = (expires, value)
        return value


def check_fits(
    num_prompt_tokens: int, max_tokens: int | None, max_model_len: int, prompt_param: str
) -> None:
    """InvalidFieldError unless the prompt plus max_tokens (at least one) fits the context."""
    if num_prompt_tokens + (max_tokens or 1) <= max_model_len:
        return
    limit = f"This model's maximum context length (max_model_len) is {max_model_len} tokens."
    if max_tokens is None or num_prompt_tokens >= max_model_len:
        raise InvalidFieldError(
            prompt_param,
            f"{limit} However, the input ({prompt_param}) is {num_prompt_tokens} tokens long, "
            f"which leaves no room for the completion. Please reduce the length of the "
            f"{prompt_param}.",
        )
    raise InvalidFieldError(
        "max_tokens",
        f"{limit} However, you requested {num_prompt_tokens + max_tokens} tokens "
        f"({num_prompt_tokens} in the {prompt_param}, {max_tokens} in the completion). "
        f"Please reduce the length of the {prompt_param} or completion.",
    )
