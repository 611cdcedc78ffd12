#!/usr/bin/env bash
# What a lent CUDA GPU settles, in one run of under 10 minutes that ends with one table.
#
#   scripts/gpu_check.sh --prepare   here, where the embedded model is installed: writes .gpu_check/model (the
#                                    model's config and tokenizer, no weights: its GGUF is over the 64 MiB that
#                                    travels to a lent machine). Wheels put in .gpu_check/wheels are installed too
#                                    (bitsandbytes, say: the GPU image lacks it).
#   scripts/gpu_check.sh             on the GPU machine, with .gpu_check carried: installs hf_accel from this
#                                    checkout with no network, runs the CUDA tests (tests/test_cuda.py and the
#                                    conformance suite's triton_flash class) and a bf16 bench of the model's
#                                    architecture with seeded random weights (tok/s and identity: stock, each feature
#                                    alone, patch(model), triton_flash without the compiled step), then the table.
#   scripts/gpu_check.sh --dry-run   anywhere: every step listed with its command; the steps that need no GPU run
#                                    (prepare into a temporary folder, install, doctor, test collection, a 4-token
#                                    CPU bench). tests/test_gpu_check.py runs it, so the script cannot rot.
#
# Options: --model DIR (a model directory or .gguf instead of .gpu_check/model), --max-new-tokens N (default 128),
# --seconds N (default 560: every step's limit shrinks to what is left of it, so the table is printed before the
# device tool's 600 s limit ends the command). PYTHON: the interpreter (default: this checkout's .venv if there is
# one, else python3). Logs, bench.json and gpu_check.md go to $OUT (set by the device tool; else a temporary
# folder): 8 files, the most a device run gives back.
set -uo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
DEFAULT_PYTHON=python3
[ -x "$ROOT/.venv/bin/python" ] && DEFAULT_PYTHON=$ROOT/.venv/bin/python
PYTHON=${PYTHON:-$DEFAULT_PYTHON}
DRY=0 PREPARE=0 MODEL="" NEW_TOKENS=128 SECONDS_IN_ALL=560
while [ $# -gt 0 ]; do
    case "$1" in
        --dry-run) DRY=1 ;;
        --prepare) PREPARE=1 ;;
        --model) MODEL=${2:?--model needs a directory or .gguf file}; shift ;;
        --max-new-tokens) NEW_TOKENS=${2:?--max-new-tokens needs a number}; shift ;;
        --seconds) SECONDS_IN_ALL=${2:?--seconds needs a number}; shift ;;
        -h|--help) sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
        *) echo "gpu_check.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
    esac
    shift
done

LOGS=${OUT:-$(mktemp -d -t gpu_check.XXXXXX)}
WORK=$(mktemp -d -t gpu_check_work.XXXXXX)
trap 'rm -rf "$WORK"' EXIT
ROWS=()
FAILED=0
DEADLINE=$(( $(date +%s) + SECONDS_IN_ALL ))

# step NAME GPU|CPU SECONDS COMMAND...: run COMMAND (its output to NAME.log and the terminal) within SECONDS, or
# what is left before the deadline, and note how it went (with pytest's counts, where it printed them). With
# --dry-run a GPU step is only listed.
step() {
    local name=$1 needs=$2 limit=$3 start result counts
    shift 3
    echo "== $name ($needs): $*"
    if [ "$DRY" = 1 ] && [ "$needs" = GPU ]; then
        ROWS+=("| $name | $needs | listed (dry run) | - |")
        return 0
    fi
    start=$(date +%s)
    [ $(( DEADLINE - start - 10 )) -lt "$limit" ] && limit=$(( DEADLINE - start - 10 ))
    if [ "$limit" -lt 5 ]; then
        ROWS+=("| $name | $needs | not run: out of time (--seconds $SECONDS_IN_ALL) | - |")
        FAILED=1
        return 0
    fi
    timeout --kill-after=5 "$limit" bash -c '"$@"' "$name" "$@" 2>&1 | tee "$LOGS/$name.log"
    local status=${PIPESTATUS[0]}
    case "$status" in
        0) result=passed ;;
        124|137) result="timed out after ${limit} s"; FAILED=1 ;;
        *) result="failed (exit $status, see $name.log)"; FAILED=1 ;;
    esac
    counts=$(grep -E '^=* ?[0-9]+ (passed|failed|skipped|errors?|deselected|tests? collected)' "$LOGS/$name.log" \
        | tail -1 | sed -E 's/^=+ //; s/ =+$//')
    ROWS+=("| $name | $needs | $result${counts:+: $counts} | $(( $(date +%s) - start )) |")
}

prepare_model() {  # the embedded model's config, generation config and tokenizer, into $1
    "$PYTHON" - "$1" <<'EOF'
import sys

from transformers import AutoConfig, AutoTokenizer, GenerationConfig

from hf_accel.tools.models import default_model_file

gguf, target = default_model_file(), sys.argv[1]
config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
config.save_pretrained(target)
GenerationConfig.from_model_config(config).save_pretrained(target)
AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(target)
print(f"wrote the config and tokenizer of {gguf.name} to {target}")
EOF
}

install_offline() {  # this checkout (and any carried wheels) into $1, from files only
    shopt -s nullglob
    local wheels=("$ROOT"/.gpu_check/wheels/*.whl)
    "$PYTHON" -m pip install -q --disable-pip-version-check --no-index --no-deps --no-build-isolation \
        --target "$1" "$ROOT" "${wheels[@]}" || return
    (cd "$1" && PYTHONPATH="$1" "$PYTHON" -c 'import hf_accel; print("hf_accel", hf_accel.__version__, "from", hf_accel.__file__)')
}

environment() {
    command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    "$PYTHON" -c 'import sys, torch, transformers; print(sys.version.split()[0], "torch", torch.__version__, "CUDA",
torch.version.cuda, "available", torch.cuda.is_available(), "transformers", transformers.__version__)'
    "$PYTHON" -c 'import triton; print("triton", triton.__version__)' 2>/dev/null || echo "triton: not installed"
}

export ROOT PYTHON
export -f prepare_model install_offline environment  # steps run them under `timeout` in a child bash

if [ "$PREPARE" = 1 ]; then
    mkdir -p "$ROOT/.gpu_check/wheels"
    prepare_model "$ROOT/.gpu_check/model" || exit 1
    echo "carry .gpu_check to the GPU machine and run scripts/gpu_check.sh there"
    exit 0
fi

CUDA_TESTS=("$ROOT/tests/test_cuda.py" "$ROOT/tests/test_conformance.py::TestTritonFlash")
BENCH=(bench --random-weights --json "$LOGS/bench.json")
# stock, each feature alone, the compiled step, patch(model); then the compiled step against triton_flash, both
# without speculation (random weights make greedy text repetitive, which flatters speculation)
BENCH_CONFIGS="hf_accel attention only,hf_accel kv_cache only,hf_accel speculative only,hf_accel kv_cache + compile"
BENCH_CONFIGS+=",hf_accel patch("
if [ "$DRY" = 1 ]; then
    step prepare CPU 300 prepare_model "$WORK/model"
    MODEL=${MODEL:-$WORK/model}
else
    MODEL=${MODEL:-$ROOT/.gpu_check/model}
    [ -e "$MODEL" ] || { echo "gpu_check.sh: no model at $MODEL: run scripts/gpu_check.sh --prepare first" >&2; exit 2; }
    "$PYTHON" -c 'import sys, torch; sys.exit(not torch.cuda.is_available())' \
        || { echo "gpu_check.sh: $PYTHON's torch sees no CUDA device: use --dry-run on a machine without one" >&2; exit 2; }
fi

step environment CPU 60 environment
step install CPU 300 install_offline "$WORK/site"
export PYTHONPATH="$WORK/site${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
cd "$WORK" || exit 1  # not the checkout, whose hf_accel would shadow the installed one
step doctor CPU 120 "$PYTHON" -m hf_accel.tools.cli doctor
step collect-tests CPU 120 "$PYTHON" -m pytest -q -p no:cacheprovider --collect-only "${CUDA_TESTS[@]}"
step cuda-tests GPU 200 "$PYTHON" -m pytest -q -p no:cacheprovider -n 4 "${CUDA_TESTS[@]}"
if [ "$DRY" = 1 ]; then
    step cpu-bench CPU 300 "$PYTHON" -m hf_accel.tools.cli "${BENCH[@]}" --model "$MODEL" --max-new-tokens 4 \
        --configs "hf_accel attention only"
fi
step bench GPU 330 "$PYTHON" -m hf_accel.tools.cli "${BENCH[@]}" --model "$MODEL" --device cuda --dtype bfloat16 \
    --max-new-tokens "$NEW_TOKENS" --configs "$BENCH_CONFIGS" --patch speculative=None \
    --patch "attention=triton_flash,compile=None,speculative=None" --patch "attention=triton_flash,compile=None"

{
    echo "| step | needs | result | seconds |"
    echo "| --- | --- | --- | --- |"
    printf '%s\n' "${ROWS[@]}"
    for log in "$LOGS/bench.log" "$LOGS/cpu-bench.log"; do
        [ -s "$log" ] && { echo; sed -n '/^| config | mean tok\/s/,/^$/p' "$log"; grep '^machine: ' "$log"; break; }
    done
} | tee "$LOGS/gpu_check.md"
echo "logs: $LOGS"
exit "$FAILED"
