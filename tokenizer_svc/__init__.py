"""kvfleet's tokenizer service: text <-> token ids, chat templates, streaming detokenization.

Modules: `service` (the kvfleet.v1.Tokenizer servicer over engine.tokenizer.Tokenizer),
`incremental` (IncrementalDetokenizer, also usable in-process by the router) and `server`
(the process entry point). Importing the package starts nothing and imports no gRPC.
"""
