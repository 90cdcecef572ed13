"""`make run`: generate for three prompts on the default model with the offline API."""

from __future__ import annotations

import argparse
import logging

from engine.llm import LLM
from engine.sampling_params import SamplingParams

PROMPTS = ["Hi, my name is", "Today is a beautiful summer day", "Hello there"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None, help="HF-format model directory")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    llm = LLM(args.model, dtype=args.dtype, seed=args.seed)
    params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=50)
    for output in llm.generate(PROMPTS, params):
        print(f"\nPrompt: {output.prompt!r}\nGenerated: {output.outputs[0].text!r}")
    print("\nstats:", llm.get_stats())


if __name__ == "__main__":
    main()
