"""What a local fleet runs: `FleetConfig` and each service's command line.

Role: the configuration of `kvfleet.fleet.Fleet` (what `kvfleet up` and tests start) and the
command lines it launches, kept apart from the process handling so each stays small. The
command lines carry no secret: the router credential, the Redis password and the TLS keys
reach the services as files (`kvfleet.fleet_credentials`), added by the fleet.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

DEFAULT_START_TIMEOUT_S = 300.0
DEFAULT_STOP_TIMEOUT_S = 15.0
# Prefill-role engines' nice increment in a local fleet (docs/disaggregation.md).
DEFAULT_PREFILL_NICE = 0


@dataclass(frozen=True)
class FleetConfig:
    model_dir: Path
    num_engines: int = 2
    redis_url: str | None = None
    host: str = "127.0.0.1"
    router_port: int = 0
    # The router's OpenAI HTTP API port (0: a free port, see Fleet.http_url).
    router_http_port: int = 0
    policy: str = "prefix"
    api_keys: Path | None = None
    # Extra engine flags, e.g. ("--num-kv-blocks", "256").
    engine_args: tuple[str, ...] = ()
    # Extra flags of engine i only, after engine_args (e.g. one engine speculating, one not);
    # engines past the end of the tuple get none.
    engine_args_by_index: tuple[tuple[str, ...], ...] = ()
    router_args: tuple[str, ...] = ()
    # Torch threads per engine (OMP_NUM_THREADS); None: torch's default (every core).
    engine_threads: int | None = None
    log_dir: Path | None = None
    log_level: str = "INFO"
    # Every service serves Prometheus /metrics on a free port, written to
    # <log_dir>/<name>.metrics-port (see ServiceProcess.metrics_port); False: --no-metrics.
    metrics: bool = True
    # The model name engines and the tokenizer report (default: the model dir's name).
    served_model_name: str | None = None
    # The tokenizer's chat template (a file or the template itself), for models without one.
    chat_template: str | None = None
    # docs/security.md: the router's runtime adapter endpoints (admins only), the adapter
    # directories (router and engines), and special tokens in prompts (tokenizer).
    allow_runtime_lora_updating: bool = False
    lora_allowed_dirs: tuple[Path, ...] = ()
    allow_special_tokens_in_prompts: bool = False
    # The password of the Redis at `redis_url` (a file; the fleet's own Redis gets a
    # generated one).
    redis_password_file: Path | None = None
    # Mutual TLS between the services and HTTPS on the router, with a throwaway CA
    # (kvfleet.fleet_tls); False: plaintext on loopback.
    tls: bool = False
    start_timeout_s: float = DEFAULT_START_TIMEOUT_S
    stop_timeout_s: float = DEFAULT_STOP_TIMEOUT_S
    # Prefill/decode disaggregation (docs/disaggregation.md): when either is set, the fleet's
    # engines are these many prefill-role engines then decode-role ones (num_engines unused).
    prefill_engines: int = 0
    decode_engines: int = 0
    # How much lower prefill-role engines run in the host's CPU priority (os.nice; 0: the
    # same as every other service). A prefill engine's prompts are throughput work; the
    # decode engine, router and clients sharing its cores are latency work.
    prefill_nice: int = DEFAULT_PREFILL_NICE
    # Engine i's CPUs (os.sched_setaffinity, like vLLM-CPU's VLLM_CPU_OMP_THREADS_BIND);
    # engines past the end of the tuple, or given (), may run on any CPU.
    engine_cpus: tuple[tuple[int, ...], ...] = ()
    # Extra flags of prefill-role and of decode-role engines only, after engine_args (as
    # llm-d and vLLM users configure prefill and decode pods apart), e.g. a prefill engine's
    # smaller --max-num-batched-tokens. Only in a disaggregated fleet.
    prefill_engine_args: tuple[str, ...] = ()
    decode_engine_args: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.num_engines < 1:
            raise ValueError(f"a fleet needs at least one engine, got {self.num_engines}")
        if self.prefill_engines < 0 or self.decode_engines < 0:
            raise ValueError("prefill_engines and decode_engines must be >= 0")
        if bool(self.prefill_engines) != bool(self.decode_engines):
            raise ValueError("a disaggregated fleet needs prefill and decode engines, got "
                             f"{self.prefill_engines} and {self.decode_engines}")
        if not 0 <= self.prefill_nice <= 19:
            raise ValueError(f"prefill_nice must be 0-19 (a nice increment), got "
                             f"{self.prefill_nice}")
        for name in ("prefill_engine_args", "decode_engine_args"):
            if getattr(self, name) and not self.prefill_engines:
                flag = "--" + name[:-1].replace("_", "-")
                raise ValueError(f"{name} ({flag}) needs a disaggregated fleet (prefill_engines"
                                 " and decode_engines > 0): colocated engines have no role")
        host = _host_cpus()
        for index, cpus in enumerate(self.engine_cpus):
            if any(cpu < 0 for cpu in cpus):
                raise ValueError(f"engine_cpus[{index}]: CPU numbers are >= 0, got {cpus}")
            if host and not set(cpus) <= host:  # else the engine would die at exec
                raise ValueError(f"engine_cpus[{index}]: CPUs {sorted(set(cpus) - host)} are "
                                 f"not among this host's {sorted(host)}")

    @property
    def engine_roles(self) -> tuple[str, ...]:
        """Engine i's --role: prefill ones first, then decode ones; else all both."""
        if self.prefill_engines:
            return ("prefill",) * self.prefill_engines + ("decode",) * self.decode_engines
        return ("both",) * self.num_engines

    def engine_own_args(self, index: int) -> tuple[str, ...]:
        """Engine i's flags after `engine_args`: its role's (`prefill_engine_args` or
        `decode_engine_args`), then its own (`engine_args_by_index`), then its --role. Later
        flags win in argparse, so a role's flag overrides a fleet-wide one."""
        roles = self.engine_roles
        role = roles[index] if index < len(roles) else "both"
        by_role = {"prefill": self.prefill_engine_args, "decode": self.decode_engine_args}
        own = self.engine_args_by_index[index] if index < len(self.engine_args_by_index) else ()
        return (*by_role.get(role, ()), *own, *(() if role == "both" else ("--role", role)))

    def engine_nice(self, index: int) -> int:
        """Engine i's nice increment: `prefill_nice` for a prefill-role engine, else 0."""
        roles = self.engine_roles
        return self.prefill_nice if index < len(roles) and roles[index] == "prefill" else 0

    def engine_cpu_set(self, index: int) -> tuple[int, ...]:
        """Engine i's CPUs (empty: any)."""
        return self.engine_cpus[index] if index < len(self.engine_cpus) else ()

    def service_cpus(self) -> tuple[int, ...]:
        """The router's, tokenizer's and Redis's CPUs (empty: any): with engines bound, the
        CPUs of this host no decoding engine (decode or both) is bound to. A floating router
        woken by a decode engine's token is placed on that engine's CPU (the kernel's wake
        affinity) and takes it from the next step; on the prefill engines' CPUs it takes
        throughput work's time instead."""
        if not self.engine_cpus:
            return ()
        roles = self.engine_roles
        decoding = {cpu for index, cpus in enumerate(self.engine_cpus)
                    if index < len(roles) and roles[index] != "prefill" for cpu in cpus}
        return tuple(sorted(set(_host_cpus()) - decoding))



def _host_cpus() -> set[int]:
    """The CPUs this process may run on (a container's cpuset, not the whole machine)."""
    return os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set()


def parse_engine_cpus(text: str) -> tuple[tuple[int, ...], ...]:
    """`FleetConfig.engine_cpus` from vLLM-CPU's VLLM_CPU_OMP_THREADS_BIND notation: engines
    separated by `|`, each a comma-separated list of CPUs and ranges (`0-1|2,3`); empty or
    `all`: no binding. ValueError naming `--engine-cpus` on anything else."""
    if text.strip() in ("", "all"):
        return ()
    engines = []
    for part in text.split("|"):
        cpus: list[int] = []
        for item in part.split(","):
            low, dash, high = item.strip().partition("-")
            if not low.isdigit() or (dash and not high.isdigit()):
                raise ValueError(f"--engine-cpus: {item.strip()!r} in {text!r} is not a CPU "
                                 "number or range (e.g. 0|1 or 0-3|4-7)")
            first, last = int(low), int(high or low)
            if last < first:
                raise ValueError(f"--engine-cpus: empty range {item.strip()!r} in {text!r}")
            cpus.extend(range(first, last + 1))
        engines.append(tuple(cpus))
    return tuple(engines)


def engine_id(index: int) -> str:
    return f"engine-{index}"


def tokenizer_command(config: FleetConfig, port: int = 0) -> list[str]:
    command = [sys.executable, "-m", "tokenizer_svc.server", "--model",
               str(_tokenizer_dir(config.model_dir)), "--host", config.host, "--port", str(port),
               *_served_name(config)]
    if config.chat_template is not None:
        command += ["--chat-template", config.chat_template]
    if config.allow_special_tokens_in_prompts:
        command.append("--allow-special-tokens-in-prompts")
    return command


def engine_command(config: FleetConfig, name: str, redis_url: str) -> list[str]:
    return [sys.executable, "-m", "engine.service.server", "--model", str(config.model_dir),
            "--engine-id", name, "--redis-url", redis_url, "--host", config.host,
            "--port", "0", *_served_name(config), *_lora_dirs(config), *config.engine_args]


def _lora_dirs(config: FleetConfig) -> list[str]:
    dirs = config.lora_allowed_dirs
    return ["--lora-allowed-dirs", *map(str, dirs)] if dirs else []


def _tokenizer_dir(model: Path) -> Path:
    """A GGUF file's tokenizer lives in its companion directory (engine.quant.gguf_file)."""
    from engine.quant.gguf_file import companion_dir, is_gguf

    return companion_dir(model) if is_gguf(model) else model


def _served_name(config: FleetConfig) -> list[str]:
    name = config.served_model_name
    if name is None and str(config.model_dir).endswith(".gguf"):
        # Engines name a model by its path's last part; the tokenizer reads another directory.
        name = config.model_dir.name
    return [] if name is None else ["--served-model-name", name]


def format_host(host: str) -> str:
    """`host` as it goes in a URL (IPv6 in brackets)."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def router_command(
    config: FleetConfig, tokenizer_address: str, redis_url: str, policy: str, port: int
) -> list[str]:
    command = [sys.executable, "-m", "router.server", "--tokenizer", tokenizer_address,
               "--redis-url", redis_url, "--policy", policy, "--host", config.host,
               "--port", str(port), *config.router_args]
    if config.api_keys is not None:
        command += ["--api-keys", str(config.api_keys)]
    if config.allow_runtime_lora_updating:
        command.append("--allow-runtime-lora-updating")
    return command + _lora_dirs(config)
