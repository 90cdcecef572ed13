"""kvfleet's router: the public entry point (gRPC and OpenAI HTTP) that picks an engine per request.

Request path (one module per job):

- `auth`            API key in gRPC metadata -> tenant (the tenant is the cache salt).
- `tokenizer_client` text / chat -> token ids via tokenizer_svc (once per request, retried
                    once on UNAVAILABLE over a new connection).
- `prefix_index`    one Redis round trip: every live engine's leading cached blocks + load.
- `policy`          pure ranking functions: `prefix` (default), `round_robin`, `least_load`.
- `routing`         glues index, pool and policy into a ranked list of engines (with the
                    load-only fallback when Redis is unreachable or busy).
- `engine_discovery` engine addresses without Redis: `--engines` and `--engine-dns`.
- `engine_pool`     gRPC channels to engines, this replica's in-flight counts, suspects,
                    GetLoad polls while Redis is down.
- `forward`         sends the request to the best engine, retrying others before the first
                    token, and relays the engine's token stream.
- `relay`           one engine stream -> client messages (the engine's text deltas, stop
                    strings applied).
- `merge`           interleaves several streams (n samples, batched prompts), each tagged.
- `limits`          the request limits (flags) checked before any work; `context_window`
                    the chosen engine's max_model_len, so a prompt that cannot fit is refused
                    before it is sent.
- `pipeline`        one request end to end: validate, tokenize, route, forward, relay (n > 1
                    fans out to one engine); shared by both front doors.
- `servicer`        the kvfleet.v1.Router gRPC servicer.
- `http_api`        the OpenAI-compatible HTTP API (`http_body` reads bodies under limits,
                    `openai_protocol` parses them, `openai_format` / `openai_stream` render
                    JSON and SSE chunks, `http_errors` renders every error);
                    `http_server` runs it with uvicorn beside gRPC.
- `server`          the process entry point.

Invariant: a router holds no state that routing correctness depends on. Everything it
caches (channels, the block size hint, the last engine list, suspects) is rebuilt from Redis
or from engine RPCs (engines found by --engines / --engine-dns while Redis is down), so any
number of replicas can run side by side and restart freely.
"""
