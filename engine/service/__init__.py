"""The engine as a gRPC service: async wrapper, Redis publisher, servicer and entry point.

- `async_engine.AsyncEngine`: runs `LLMEngine.step()` on a dedicated thread and streams
  per-request outputs to asyncio consumers; `engine_state` holds the snapshots it hands over
  (`GenerateOutput`, `EngineLoad`, `StepProgress`).
- `output_text`: the engine's own incremental detokenization of each request's tokens.
- `redis_publisher.RedisPublisher`: keeps the engine's registry entry, load and block index
  in Redis (layout: `kvfleet.contracts.redis_schema`).
- `servicer.EngineServicer`: kvfleet.v1.Engine over an `AsyncEngine`.
- `step_watchdog.StepWatchdog`: gRPC health NOT_SERVING while the step loop is stalled or dead.
- `lora_flags`: the LoRA flags (KV tier flags are `engine.kv_tiers.flags`; keep-alives are
  a contract, `kvfleet.contracts.keepalive`).
- `server`: `python -m engine.service.server` wires them together.
"""
