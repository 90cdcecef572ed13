"""Client-side load for the fault suite: streaming gRPC clients that record what they saw.

Role: `Load` runs `concurrency` worker threads, each sending streamed Generate requests to the
router back to back until stopped (or a fixed number of requests in all), and records one
`Outcome` per request. Every call carries a client deadline, so a request the fleet never
finishes shows up as "hung" instead of hanging the test.

Outcome kinds (what a client can tell):
- "ok": the stream ended with a finish_reason;
- "error": the call failed with a status a client can act on (not UNKNOWN/INTERNAL) and a
  message that says what happened;
- "unclear": it failed with UNKNOWN/INTERNAL or an empty message;
- "hung": the client's own deadline expired;
- "lost": the stream ended without error and without a finish_reason (a silently lost
  request: this must never happen).
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import grpc

from kvfleet.v1 import common_pb2, router_pb2, router_pb2_grpc

CLEAR_CODES = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.ABORTED,
        grpc.StatusCode.CANCELLED,
    }
)


TEXT_PROMPT = "The quick brown fox jumps over the lazy dog while the fleet keeps serving."
ERROR_BACKOFF_S = 0.1


@dataclass(frozen=True)
class Outcome:
    kind: str  # ok | error | unclear | hung | lost | cancelled (by the client, on purpose)
    started: float  # time.monotonic()
    ended: float
    first_token: float | None = None
    code: str = ""
    message: str = ""
    engine_id: str = ""
    num_tokens: int = 0


@dataclass(frozen=True)
class LoadConfig:
    concurrency: int = 4
    # Requests in all (None: until stopped).
    total_requests: int | None = None
    prompt_tokens: tuple[int, int] = (20, 120)
    max_tokens: int = 64
    vocab_size: int = 512
    first_plain_id: int = 3
    # The client's own deadline per request: past it the request counts as hung.
    deadline_s: float = 30.0
    # Requests share one of this many prefixes (so prefix routing has something to do).
    num_prefixes: int = 4
    seed: int = 0


@dataclass
class Load:
    address: str
    config: LoadConfig = field(default_factory=LoadConfig)
    outcomes: list[Outcome] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._issued = 0
        self._threads: list[threading.Thread] = []
        self._channel = grpc.insecure_channel(self.address)
        self._stub = router_pb2_grpc.RouterStub(self._channel)
        rng = random.Random(self.config.seed)
        self._prefixes = [
            [rng.randrange(self.config.first_plain_id, self.config.vocab_size) for _ in range(48)]
            for _ in range(self.config.num_prefixes)
        ]

    def start(self) -> Load:
        for index in range(self.config.concurrency):
            thread = threading.Thread(target=self._worker, args=(index,), daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def stop(self) -> None:
        """Stop issuing requests and wait for those in flight (bounded by their deadlines)."""
        self._stop.set()
        self.join()

    def join(self) -> None:
        for thread in self._threads:
            thread.join(self.config.deadline_s + 10)
        self._channel.close()

    def wait_for(self, predicate, timeout_s: float) -> bool:  # type: ignore[no-untyped-def]
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self._lock:
                if predicate(list(self.outcomes)):
                    return True
            time.sleep(0.02)
        return False

    def _next_prompt(self, rng: random.Random) -> list[int] | None:
        with self._lock:
            total = self.config.total_requests
            if self._stop.is_set() or (total is not None and self._issued >= total):
                return None
            self._issued += 1
        low, high = self.config.prompt_tokens
        prefix = rng.choice(self._prefixes)
        tail = [rng.randrange(self.config.first_plain_id, self.config.vocab_size)
                for _ in range(max(1, rng.randint(low, high) - len(prefix)))]
        return prefix + tail

    def _worker(self, index: int) -> None:
        rng = random.Random(self.config.seed * 1000 + index)
        count = 0
        while (prompt := self._next_prompt(rng)) is not None:
            # Every other request is text, so the router also needs the tokenizer service.
            text = TEXT_PROMPT if count % 2 == 1 else None
            count += 1
            outcome = self.send(prompt, text=text)
            with self._lock:
                self.outcomes.append(outcome)
            if outcome.kind != "ok":
                time.sleep(ERROR_BACKOFF_S)  # like a client's retry backoff, not a hot loop

    def send(
        self,
        prompt: Sequence[int],
        cancel_after_tokens: int | None = None,
        cancel_after_s: float | None = None,
        text: str | None = None,
        hold: Callable[[], None] | None = None,
    ) -> Outcome:
        """One streamed request (of `text` when given, else of the token ids);
        `cancel_after_*` make the client vanish on purpose."""
        params = common_pb2.SamplingParams(
            temperature=0.0, max_tokens=self.config.max_tokens, ignore_eos=True
        )
        if text is not None:
            request = router_pb2.RouterGenerateRequest(prompt=text, sampling_params=params)
        else:
            request = router_pb2.RouterGenerateRequest(
                prompt_token_ids=common_pb2.TokenIds(ids=list(prompt)), sampling_params=params
            )
        started = time.monotonic()
        first_token: float | None = None
        num_tokens = 0
        call = self._stub.Generate(request, timeout=self.config.deadline_s)
        timer = None
        if cancel_after_s is not None:
            timer = threading.Timer(cancel_after_s, call.cancel)
            timer.start()
        try:
            for response in call:
                if response.token_ids and first_token is None:
                    first_token = time.monotonic()
                num_tokens += len(response.token_ids)
                if cancel_after_tokens is not None and num_tokens >= cancel_after_tokens:
                    if hold is not None:
                        hold()  # the caller decides when this client vanishes
                    call.cancel()
                    return Outcome("cancelled", started, time.monotonic(), first_token,
                                   num_tokens=num_tokens)
                if response.HasField("finish_reason"):
                    return Outcome("ok", started, time.monotonic(), first_token,
                                   engine_id=response.engine_id, num_tokens=num_tokens)
        except grpc.RpcError as e:
            if cancel_after_s is not None and e.code() == grpc.StatusCode.CANCELLED:  # type: ignore[attr-defined]
                return Outcome("cancelled", started, time.monotonic(), first_token,
                               num_tokens=num_tokens)
            return _failed(e, started, first_token, num_tokens)
        finally:
            if timer is not None:
                timer.cancel()
        return Outcome("lost", started, time.monotonic(), first_token, num_tokens=num_tokens)


def _failed(
    error: grpc.RpcError, started: float, first_token: float | None, num_tokens: int
) -> Outcome:
    code = error.code()  # type: ignore[attr-defined]
    message = error.details() or ""  # type: ignore[attr-defined]
    # The client's own deadline says exactly this; a server-side deadline says why.
    if code == grpc.StatusCode.DEADLINE_EXCEEDED and message == "Deadline Exceeded":
        kind = "hung"
    elif code in CLEAR_CODES and message:
        kind = "error"
    else:
        kind = "unclear"
    return Outcome(kind, started, time.monotonic(), first_token, code=code.name,
                   message=message, num_tokens=num_tokens)


def tally(outcomes: Sequence[Outcome]) -> Counter[str]:
    return Counter(outcome.kind for outcome in outcomes)
