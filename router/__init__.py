"""kvfleet's router: the public entry point (gRPC and OpenAI HTTP) that picks an engine per request.

Layout (packages by concern, top-level modules for what spans them):

- `server`            process entry point: flags -> `RouterConfig`, everything wired, served.
- `servicer`          the gRPC front door (kvfleet.v1.Router): authenticate, call the pipeline.
- `pipeline`          `GenerationPipeline`: one request end to end, shared by both front doors.
- `request_limits`    the request-size flags and the checks made before any work.
- `tokenizer_client`  text / chat -> token ids via tokenizer_svc (retried once on UNAVAILABLE).
- `metrics`           the router's Prometheus metrics.
- `http/`             the HTTP front door: the FastAPI app (`app`), bodies read under limits
                      (`body`), OpenAI error JSON (`errors`), vLLM's extra and LoRA endpoints,
                      the OpenAPI document, uvicorn beside gRPC (`uvicorn_server`).
- `openai/`           pure OpenAI protocol: body parsing (`requests`, `tokenize_bodies`) and
                      rendering of JSON and SSE chunks (`render`, `responses`).
- `tenancy/`          tenants: API keys, the tenant policy file and its hot reload, per-request
                      rules, rate limits (Redis Lua, and per replica while Redis is down).
- `routing/`          where a prompt goes: the Redis prefix index, pure ranking policies, the
                      decision that glues them, LoRA adapters and their placement.
- `engines/`          talking to engines: channels (`pool`), discovery without Redis, dispatch
                      with retries, stream relay, merging streams, context windows.

Request path, by stage (`pipeline.GenerationPipeline.generate` calls one method per stage):

1. parse     front door: protobuf (`servicer`) or an OpenAI body (`http.app`,
             `openai.requests`); the API key -> tenant (`tenancy.api_keys`), the cache salt.
2. admit     sampling rules, `request_limits`, the tenant's rules (`tenancy.request_rules`).
3. tokenize  `tokenizer_client`, once per request; then `--max-input-tokens` and the tenant's
             rate limits on the prompt's tokens (`tenancy.rate_limit`).
4. route     engines ranked by cached prefix and load (`routing.decision`), the prompt checked
             against the context window (`engines.context_window`).
5. stream    the best engine, retrying others before the first token (`engines.dispatch`);
             n > 1 fanned out to it; text relayed (`engines.stream_relay`) and merged
             (`engines.merge`).
6. render    front door: protobuf messages as they come (`servicer`), or OpenAI JSON / SSE
             (`openai.responses`, `openai.render`; errors: `http.errors`).

Invariant: a router holds no state that routing correctness depends on. Everything it
caches (channels, the block size hint, the last engine list, suspects) is rebuilt from Redis
or from engine RPCs (engines found by --engines / --engine-dns while Redis is down), so any
number of replicas can run side by side and restart freely.
"""
