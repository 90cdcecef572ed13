"""gRPC channels to engines, plus what only this router replica knows about them.

Role: `EnginePool` hands out an Engine stub per (engine id, address), counts this replica's
in-flight requests per engine (a fresher load signal than Redis for its own traffic), keeps
a short suspect list (engines that just failed a call), and remembers the last engine list
Redis reported so that routing by load alone still works while Redis is down.

Invariants:
- Nothing here is needed for correct routing: a fresh replica with an empty pool routes
  exactly as well once Redis answers (the suspect list and counts only sharpen it).
- A channel is replaced when an engine id shows up at a new address (a restarted engine),
  and closed only when the engine left the registry and no request of ours streams from it.
- A suspect engine stays suspect for `suspect_s` unless it re-registers at a new address.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import grpc
import grpc.aio

from kvfleet.v1 import engine_pb2, engine_pb2_grpc
from router.policy import EngineView

logger = logging.getLogger(__name__)

# Long enough for a dead engine's registry entry to expire (kvfleet.redis_schema TTL 5 s).
DEFAULT_SUSPECT_S = 6.0


@dataclass
class _Channel:
    address: str
    channel: grpc.aio.Channel
    stub: engine_pb2_grpc.EngineStub


class EnginePool:
    def __init__(
        self, suspect_s: float = DEFAULT_SUSPECT_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._suspect_s = suspect_s
        self._clock = clock
        self._channels: dict[str, _Channel] = {}
        self._in_flight: dict[str, int] = {}
        self._suspects: dict[str, tuple[float, str]] = {}  # id -> (until, address)
        self._known: dict[str, str] = {}  # id -> address, from the last registry read
        self._closing: set[asyncio.Future[None]] = set()

    def stub(self, engine_id: str, address: str) -> engine_pb2_grpc.EngineStub:
        entry = self._channels.get(engine_id)
        if entry is None or entry.address != address:
            if entry is not None:
                self._close_later(entry)
            channel = grpc.aio.insecure_channel(address)
            entry = _Channel(address, channel, engine_pb2_grpc.EngineStub(channel))
            self._channels[engine_id] = entry
        return entry.stub

    def in_flight(self, engine_id: str) -> int:
        return self._in_flight.get(engine_id, 0)

    def begin(self, engine_id: str) -> None:
        """One more of our requests is in flight on `engine_id` (pair with `end`)."""
        self._in_flight[engine_id] = self._in_flight.get(engine_id, 0) + 1

    def end(self, engine_id: str) -> None:
        self._in_flight[engine_id] -= 1

    def mark_suspect(self, engine_id: str, address: str) -> None:
        logger.warning("engine %s at %s failed; avoiding it for %.0fs", engine_id, address,
                       self._suspect_s)
        self._suspects[engine_id] = (self._clock() + self._suspect_s, address)

    def is_suspect(self, engine_id: str, address: str) -> bool:
        entry = self._suspects.get(engine_id)
        if entry is None:
            return False
        until, suspect_address = entry
        if self._clock() >= until or suspect_address != address:
            del self._suspects[engine_id]  # expired, or restarted elsewhere
            return False
        return True

    def remember(self, addresses: Mapping[str, str]) -> None:
        """The live engines Redis just reported (id -> address); drops channels of the gone."""
        self._known = dict(addresses)
        for engine_id in list(self._channels):
            if engine_id not in self._known and self.in_flight(engine_id) == 0:
                self._close_later(self._channels.pop(engine_id))

    @property
    def known(self) -> Mapping[str, str]:
        return self._known

    async def fetch_loads(self, timeout_s: float) -> list[EngineView]:
        """Load of every remembered engine straight from the engines (Redis is down)."""
        ids = list(self._known)
        results = await asyncio.gather(
            *(self._get_load(i, self._known[i], timeout_s) for i in ids), return_exceptions=True
        )
        views = []
        for engine_id, result in zip(ids, results, strict=True):
            if isinstance(result, engine_pb2.LoadInfo):
                views.append(self._view_from_load(engine_id, result))
            elif isinstance(result, grpc.aio.AioRpcError):
                self.mark_suspect(engine_id, self._known[engine_id])
            elif isinstance(result, BaseException):
                raise result
        return views

    async def _get_load(
        self, engine_id: str, address: str, timeout_s: float
    ) -> engine_pb2.LoadInfo:
        stub = self.stub(engine_id, address)
        response: engine_pb2.LoadInfo = await stub.GetLoad(
            engine_pb2.GetLoadRequest(), timeout=timeout_s
        )
        return response

    def _view_from_load(self, engine_id: str, load: engine_pb2.LoadInfo) -> EngineView:
        return EngineView(
            engine_id=engine_id,
            address=self._known[engine_id],
            num_running=load.num_running,
            num_waiting=load.num_waiting,
            kv_cache_usage=load.kv_cache_usage,
            in_flight=self.in_flight(engine_id),
        )

    async def close(self) -> None:
        channels = list(self._channels.values())
        self._channels.clear()
        await asyncio.gather(
            *(c.channel.close() for c in channels), *self._closing, return_exceptions=True
        )

    def _close_later(self, entry: _Channel) -> None:
        # Closing is async; a sync caller schedules it (nothing of ours uses the channel).
        task = asyncio.ensure_future(entry.channel.close())
        self._closing.add(task)  # the loop only keeps weak references to tasks
        task.add_done_callback(self._closing.discard)
