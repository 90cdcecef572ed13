"""The router's chat-output flags, named as vLLM's: `--enable-auto-tool-choice`,
`--tool-call-parser NAME`, `--reasoning-parser NAME` -> `ChatOutputConfig`.

Role: argument parsing only; parser names come from the registries
(`router.openai.tool_parsers`, `router.openai.reasoning`). `--enable-auto-tool-choice`
without a parser stops the start, as in vLLM.
"""

from __future__ import annotations

import argparse

from router.openai.chat_output import ChatOutputConfig
from router.openai.reasoning import reasoning_parser_names
from router.openai.tool_parsers import tool_parser_names


def add_chat_output_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("tool calling and reasoning (docs/tool-calling.md)")
    group.add_argument("--enable-auto-tool-choice", action="store_true",
                       help='allow tool_choice "auto" (the default when a chat request has '
                            "tools); needs --tool-call-parser")
    group.add_argument("--tool-call-parser", choices=tool_parser_names(), default=None,
                       help="how tool calls are read from the model's output (hermes: "
                            "<tool_call>{...}</tool_call>, Hermes and Qwen models)")
    group.add_argument("--reasoning-parser", choices=reasoning_parser_names(), default=None,
                       help="split <think> reasoning into the reasoning_content field "
                            "(deepseek_r1: reasoning up to </think>; qwen3: when the output "
                            "opens with <think>)")


def chat_output_config(
    parser: argparse.ArgumentParser, args: argparse.Namespace
) -> ChatOutputConfig:
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        parser.error("--enable-auto-tool-choice requires --tool-call-parser")
    return ChatOutputConfig(
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
    )
