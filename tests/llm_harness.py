"""Run vLLM's offline ``LLM`` in a fresh process and write what it produced as JSON.

Each run gets its own process because vLLM resolves its platform once per process: the same
script serves our plugin and, with ``VLLM_PLUGINS=none``, vLLM's native CPU backend (the
reference of the differential tests).

Usage: ``python tests/llm_harness.py SPEC.json OUT.json`` where SPEC holds
``{"model": str, "engine": {LLM kwargs}, "requests": [{"prompt" | "prompt_token_ids", "params":
{SamplingParams kwargs}}], "rpc": [worker method names called before and after generation]}``.
"""

from __future__ import annotations

import json
import sys


def main(spec_path: str, out_path: str) -> None:
    with open(spec_path, encoding="utf-8") as f:
        spec = json.load(f)
    from vllm import LLM, SamplingParams
    from vllm.platforms import current_platform

    llm = LLM(model=spec["model"], **spec.get("engine", {}))
    rpc = spec.get("rpc", [])
    before = {name: llm.collective_rpc(name)[0] for name in rpc}
    prompts, params = [], []
    for req in spec["requests"]:
        if "prompt_token_ids" in req:
            prompts.append({"prompt_token_ids": req["prompt_token_ids"]})
        else:
            prompts.append(req["prompt"])
        params.append(SamplingParams(**req.get("params", {})))
    results = llm.generate(prompts, params, use_tqdm=False)
    outputs = []
    for res in results:
        completions = []
        for c in res.outputs:
            logprobs = None
            if c.logprobs is not None:
                logprobs = [
                    sorted(((int(t), float(lp.logprob)) for t, lp in step.items()),
                           key=lambda x: -x[1])
                    for step in c.logprobs
                ]
            completions.append({"token_ids": list(c.token_ids), "text": c.text,
                                "logprobs": logprobs})
        outputs.append({"prompt_token_ids": list(res.prompt_token_ids or []),
                        "completions": completions})
    after = {name: llm.collective_rpc(name)[0] for name in rpc}
    out = {
        "platform": f"{type(current_platform).__module__}.{type(current_platform).__name__}",
        "outputs": outputs,
        "rpc_before": before,
        "rpc_after": after,
    }
    with open(out_path, "w", encoding="utf-8") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
