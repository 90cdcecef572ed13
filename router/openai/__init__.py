"""OpenAI request and response shapes, pure (no I/O): parsing in, rendering out.

- `requests`: completions and chat bodies -> RouterGenerateRequest (field-naming errors).
- `render`: router responses -> OpenAI JSON objects (choices, usage, logprobs).
- `responses`: one request's router messages -> a whole body or SSE chunks.
- `tokenize_bodies`: vLLM's /tokenize and /detokenize bodies.
"""
