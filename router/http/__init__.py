"""The router's HTTP front door: the OpenAI-compatible API and vLLM's serving endpoints.

- `app`: the FastAPI app (/v1/completions, /v1/chat/completions, /v1/models, /health).
- `body`: request bodies read under limits and decoded as JSON.
- `errors`: every failure rendered as OpenAI error JSON.
- `vllm_endpoints`: /tokenize, /detokenize, /version, /ping, /metrics.
- `lora_endpoints`: /v1/load_lora_adapter, /v1/unload_lora_adapter.
- `openapi_doc`: /openapi.json and /docs; `uvicorn_server`: runs the app beside gRPC.
"""
