"""Text handling shared by the engine, the tokenizer service and the router.

- `tokenizer`: a model directory's tokenizer.json and chat template, EOS ids.
- `chat_template`: `--chat-template` given as a file or inline (vLLM's flag).
- `incremental`: incremental detokenization that never splits a character.
- `stop_strings`: stop strings matched on streamed text.
- `output_rules`: the rules every output path applies (stop strings, the ending EOS, min_tokens),
  written once for the offline API, the engine service and the router.

Invariant: imports no service; torch-free.
"""
