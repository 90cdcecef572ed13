"""Grammar-constrained decoding (structured outputs) in the engine.

`backend` is the interface a grammar library plugs into (compile a constraint once, then one
matcher per sample); `llguidance_backend` implements it on llguidance; `manager` owns the
backend, the compile cache, the step and draft masks and the figures metrics read; `bitmask`
turns matchers' packed token bitmasks into the sampler's allowed-token masks; `advance` feeds
committed tokens to a request's matcher (the scheduler calls it).
"""
