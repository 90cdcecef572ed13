"""The router's side of the engines: finding them, talking to them, relaying their streams.

- `pool`: gRPC channels, this replica's in-flight counts, suspects, GetLoad polls.
- `discovery`: engine addresses without Redis (`--engines`, `--engine-dns`).
- `dispatch`: send a request down the ranking until one engine starts streaming.
- `stream_relay`: one engine stream -> the router's responses (stop strings applied).
- `merge`: interleave several streams (n samples, batched prompts), each tagged.
- `context_window`: the chosen engine's max_model_len, checked before sending.
"""
