"""gRPC channels to engines, plus what only this router replica knows about them.

Role: `EnginePool` hands out an Engine stub per (engine id, address), counts this replica's
in-flight requests per engine (a fresher load signal than Redis for its own traffic), and of
those the ones before their first token with the prompt tokens they leave to compute, keeps
a short suspect list (engines that just failed a call), and remembers the last engine list
it learned (from Redis, or from the engines themselves) so that routing without Redis works.
`poll` asks engines for their load, id and model (GetLoad) when Redis cannot answer.

Invariants:
- Nothing here is needed for correct routing: a fresh replica with an empty pool routes
  exactly as well once Redis answers (the suspect list and counts only sharpen it).
- One channel per address. When an engine id shows up at a new address (a restarted
  engine), its old address' channel is closed; a channel is otherwise closed only once no
  known engine lives at its address and no request of ours streams from it.
- A suspect engine stays suspect for `suspect_s` unless it re-registers at a new address.
- A load poll marks an engine suspect only when the engine cannot be reached (UNAVAILABLE:
  refused, reset, no route). A slow answer (DEADLINE_EXCEEDED) is a busy engine, not a
  failed one: it stays a candidate with the load it last reported.
- With TLS (`tls`), a channel is keyed by address *and* the name the engine's certificate
  must carry: its id from Redis for calls to that engine, the engine role for polls by
  address (kvfleet.runtime.tls). A peer that fails the handshake gets no request, and so
  never the router credential; it is logged and avoided like an unreachable engine.
- Concurrent polls are one poll: every caller awaits the same GetLoad round, so a burst of
  decisions while Redis is down costs one RPC per engine, not one per request per engine.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, replace

import grpc
import grpc.aio

from kvfleet.runtime.service_auth import credential_metadata
from kvfleet.runtime.tls import ClientTls, aio_channel, engine_name, is_handshake_failure
from kvfleet.v1 import engine_pb2, engine_pb2_grpc
from router.metrics import RouterMetrics
from router.routing.prefix_index import EngineRecord

logger = logging.getLogger(__name__)

# Long enough for a dead engine's registry entry to expire (kvfleet.contracts.redis_schema TTL 5 s).
DEFAULT_SUSPECT_S = 6.0


@dataclass
class _Channel:
    channel: grpc.aio.Channel
    stub: engine_pb2_grpc.EngineStub


class EnginePool:
    def __init__(
        self,
        suspect_s: float = DEFAULT_SUSPECT_S,
        clock: Callable[[], float] = time.monotonic,
        metrics: RouterMetrics | None = None,
        router_secret: str | None = None,
        tls: ClientTls | None = None,
    ) -> None:
        self._suspect_s = suspect_s
        self._tls = tls
        # What every Generate and Abort call presents to engines (kvfleet.runtime.service_auth).
        self.credential = credential_metadata(router_secret)
        self._clock = clock
        self._metrics = metrics
        # (address, the name its certificate must carry; None without TLS) -> channel
        self._channels: dict[tuple[str, str | None], _Channel] = {}
        self._dialed: dict[str, str] = {}  # engine id -> the address we last dialed it at
        self._in_flight: dict[str, int] = {}
        # id -> (our requests before their first token, their uncached prompt tokens): the
        # prefill work the engine's published queue may not show yet (router.routing.ttft_cost).
        self._prefilling: dict[str, tuple[int, int]] = {}
        self._suspects: dict[str, tuple[float, str]] = {}  # id -> (until, address)
        self._known: dict[str, EngineRecord] = {}  # id -> last report, matched_blocks 0
        self._closing: set[asyncio.Future[None]] = set()
        self._poll: asyncio.Future[list[EngineRecord]] | None = None

    def stub(self, engine_id: str, address: str) -> engine_pb2_grpc.EngineStub:
        previous = self._dialed.get(engine_id)
        self._dialed[engine_id] = address
        if previous is not None and previous != address:
            self._close_unused(previous)  # the engine restarted elsewhere
        return self._channel(address, engine_id).stub

    def in_flight(self, engine_id: str) -> int:
        return self._in_flight.get(engine_id, 0)

    def prefilling(self, engine_id: str) -> int:
        """Our requests on `engine_id` that have no first token yet."""
        return self._prefilling.get(engine_id, (0, 0))[0]

    def prefill_tokens(self, engine_id: str) -> int:
        """The prompt tokens those requests make the engine compute (their uncached part)."""
        return self._prefilling.get(engine_id, (0, 0))[1]

    def begin(self, engine_id: str, prefill_tokens: int = 0) -> None:
        """One more of our requests is in flight on `engine_id` (pair with `end`), and before
        its first token, with that much prompt to compute (pair with `prefilled`)."""
        self._in_flight[engine_id] = self._in_flight.get(engine_id, 0) + 1
        count, tokens = self._prefilling.get(engine_id, (0, 0))
        self._prefilling[engine_id] = (count + 1, tokens + prefill_tokens)

    def prefilled(self, engine_id: str, prefill_tokens: int = 0) -> None:
        """A request `begin` counted got its first token, or will never get one here."""
        count, tokens = self._prefilling[engine_id]
        if count <= 1:
            del self._prefilling[engine_id]
        else:
            self._prefilling[engine_id] = (count - 1, tokens - prefill_tokens)

    def end(self, engine_id: str) -> None:
        self._in_flight[engine_id] -= 1

    def note_failure(self, engine_id: str, address: str, error: grpc.aio.AioRpcError) -> None:
        """Log a call that failed because the peer did not prove it is this engine."""
        if self._tls is not None and is_handshake_failure(error.details()):
            logger.error("engine %s at %s did not prove its identity (TLS handshake: %s): "
                         "no request and no router credential sent; a registry entry "
                         "naming a foreign address, or a certificate not from the fleet CA "
                         "for %s", engine_id, address, error.details(),
                         engine_name(self._tls.name, engine_id))

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

    def remember(self, records: Iterable[EngineRecord]) -> None:
        """The live engines just reported; drops the channels of engines that are gone."""
        # Kept as reported (a copy per record per decision cost ~1 us x engines); `known`
        # strips the prompt's match when it is read (rarely: only routing without Redis).
        self._known = {r.engine_id: r for r in records if r.address}
        for engine_id in list(self._dialed):
            if engine_id not in self._known and self.in_flight(engine_id) == 0:
                self._close_unused(self._dialed.pop(engine_id))

    def remember_some(self, records: Iterable[EngineRecord]) -> None:
        """Engines a large fleet's candidate lookup reported: updated, no other one dropped
        (the next complete answer drops the gone ones)."""
        for record in records:
            if record.address:
                self._known[record.engine_id] = record

    @property
    def known(self) -> list[EngineRecord]:
        """The last engine list learned (matched_blocks 0: it belongs to no prompt)."""
        return [replace(r, matched_blocks=0) for r in self._known.values()]

    async def poll(self, addresses: Collection[str], timeout_s: float) -> list[EngineRecord]:
        """Every engine at `addresses` or known from before, as its GetLoad reports it.

        Concurrent callers share one poll (the first caller's addresses).
        """
        if self._poll is None:
            self._poll = asyncio.ensure_future(self._poll_once(addresses, timeout_s))
            self._poll.add_done_callback(self._poll_done)
        # Shielded: one caller giving up must not cancel the poll the others wait for.
        return await asyncio.shield(self._poll)

    def _poll_done(self, _: asyncio.Future[list[EngineRecord]]) -> None:
        self._poll = None

    async def _poll_once(
        self, addresses: Collection[str], timeout_s: float
    ) -> list[EngineRecord]:
        known_at = {r.address: r for r in self._known.values()}
        targets = sorted(set(addresses) | set(known_at))
        results = await asyncio.gather(
            *(self._get_load(address, timeout_s) for address in targets),
            return_exceptions=True,
        )
        records: dict[str, EngineRecord] = {}
        for address, result in zip(targets, results, strict=True):
            record = self._record_from_poll(address, result, known_at.get(address))
            if record is not None:
                records.setdefault(record.engine_id, record)
        self.remember(records.values())
        for address in targets:
            if address not in {r.address for r in records.values()}:
                self._close_unused(address)
        return list(records.values())

    def _record_from_poll(
        self,
        address: str,
        result: engine_pb2.LoadInfo | BaseException,
        known: EngineRecord | None,
    ) -> EngineRecord | None:
        """The engine at `address` after one GetLoad, or None when it is not a candidate."""
        if isinstance(result, engine_pb2.LoadInfo) and result.engine_id:
            self._count_poll("ok")
            record = _record_from_load(address, result)
            if self._dialed.get(record.engine_id, address) != address:
                self.stub(record.engine_id, address)  # moved: retire the old channel
            return record
        if isinstance(result, engine_pb2.LoadInfo):  # no id: not an engine we can route to
            self._count_poll("error")
            return None
        if not isinstance(result, grpc.aio.AioRpcError):
            raise result
        if result.code() is grpc.StatusCode.UNAVAILABLE:
            self._count_poll("unavailable")
            if known is not None:
                self.mark_suspect(known.engine_id, address)
            return None
        # Slow or otherwise odd answer: still a candidate if we know who lives there.
        self._count_poll("timeout" if result.code() is grpc.StatusCode.DEADLINE_EXCEEDED
                         else "error")
        logger.debug("engine at %s did not report its load: %s", address, result.code().name)
        return known

    async def _get_load(self, address: str, timeout_s: float) -> engine_pb2.LoadInfo:
        response: engine_pb2.LoadInfo = await self._channel(address, None).stub.GetLoad(
            engine_pb2.GetLoadRequest(), timeout=timeout_s
        )
        return response

    def _count_poll(self, outcome: str) -> None:
        if self._metrics is not None:
            self._metrics.load_polls.labels(outcome).inc()

    def _channel(self, address: str, engine_id: str | None) -> _Channel:
        """The channel to `address`, verifying (TLS) that the peer is `engine_id`, or any
        fleet engine for None."""
        name = None if self._tls is None else engine_name(self._tls.name, engine_id)
        entry = self._channels.get((address, name))
        if entry is None:
            channel = aio_channel(address, self._tls, name)
            entry = _Channel(channel, engine_pb2_grpc.EngineStub(channel))
            self._channels[(address, name)] = entry
        return entry

    def _close_unused(self, address: str) -> None:
        """Close `address`' channel unless an engine we know or stream from lives there."""
        users = [i for i, a in self._dialed.items() if a == address]
        known = any(r.address == address for r in self._known.values())
        if known or any(self.in_flight(i) for i in users):
            return
        for engine_id in users:
            del self._dialed[engine_id]
        for key in [k for k in self._channels if k[0] == address]:
            entry = self._channels.pop(key)
            # Closing is async; a sync caller schedules it (nothing of ours uses the channel).
            task = asyncio.ensure_future(entry.channel.close())
            self._closing.add(task)  # the loop only keeps weak references to tasks
            task.add_done_callback(self._closing.discard)

    async def close(self) -> None:
        channels = list(self._channels.values())
        self._channels.clear()
        await asyncio.gather(
            *(c.channel.close() for c in channels), *self._closing, return_exceptions=True
        )


def _record_from_load(address: str, load: engine_pb2.LoadInfo) -> EngineRecord:
    """A GetLoad answer in the registry's field names (kvfleet/contracts/redis_schema.py)."""
    return EngineRecord(
        engine_id=load.engine_id,
        matched_blocks=0,
        num_cached_blocks=0,
        fields={
            "address": address,
            "epoch": load.epoch,
            "block_size": str(load.block_size),
            "model": load.model_name,
            "max_model_len": str(load.max_model_len),
            "num_running": str(load.num_running),
            "num_waiting": str(load.num_waiting),
            "kv_cache_usage": repr(load.kv_cache_usage),
            "kv_blocks_free": str(load.kv_blocks_free),
            "kv_blocks_total": str(load.kv_blocks_total),
            "lora_adapters": json.dumps(list(load.lora_adapters)),
        },
    )
