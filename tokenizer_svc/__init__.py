"""kvfleet's tokenizer service: text <-> token ids, chat templates, streaming detokenization.

Modules: `service` (the kvfleet.v1.Tokenizer servicer over `kvfleet.text.tokenizer.Tokenizer`)
and `server` (the process entry point). The text code itself (tokenizer loading, chat
templates, the incremental detokenizer engines also use in-process) is `kvfleet.text`.
The router calls this service once per request (Tokenize), never per generated token;
replicas are interchangeable (no state between RPCs). Importing the package starts nothing
and imports no gRPC.
"""
