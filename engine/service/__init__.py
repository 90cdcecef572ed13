"""The engine as a gRPC service: async wrapper, Redis publisher, servicer and entry point.

- `async_engine.AsyncEngine`: runs `LLMEngine.step()` on a dedicated thread and streams
  per-request outputs to asyncio consumers.
- `redis_publisher.RedisPublisher`: keeps the engine's registry entry, load and block index
  in Redis (layout: `kvfleet.redis_schema`).
- `servicer.EngineServicer`: kvfleet.v1.Engine over an `AsyncEngine`.
- `server`: `python -m engine.service.server` wires the three together.
"""
