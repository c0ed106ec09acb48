"""Run vLLM's offline engine through phases in one process and write what happened as JSON
(tests/test_hybrid_models.py: a request that finished or was aborted must not leak its
recurrent state into later requests).

Usage: ``python tests/hybrid_harness.py SPEC.json OUT.json``; SPEC holds ``{"model", "engine":
{LLM kwargs}, "phases": [...]}`` where a phase is ``{"generate": [{"prompt_token_ids",
"params"}]}``, ``{"abort": {"prompt_token_ids", "params", "steps": n}}`` (add the request, run
n engine steps, abort it) or ``{"rpc": name}``.
"""

from __future__ import annotations

import json
import sys


def main(spec_path: str, out_path: str) -> None:
    with open(spec_path, encoding="utf-8") as f:
        spec = json.load(f)
    from vllm import LLM, SamplingParams

    llm = LLM(model=spec["model"], **spec.get("engine", {}))
    results = []
    for phase in spec["phases"]:
        if "generate" in phase:
            reqs = phase["generate"]
            outs = llm.generate([{"prompt_token_ids": r["prompt_token_ids"]} for r in reqs],
                                [SamplingParams(**r["params"]) for r in reqs], use_tqdm=False)
            results.append([list(o.outputs[0].token_ids) for o in outs])
        elif "abort" in phase:
            req = phase["abort"]
            engine = llm.llm_engine
            engine.add_request("to-abort", {"prompt_token_ids": req["prompt_token_ids"]},
                               SamplingParams(**req["params"]))
            tokens = []
            for _ in range(req["steps"]):
                for out in engine.step():
                    tokens = list(out.outputs[0].token_ids)
            engine.abort_request(["to-abort"])
            while engine.has_unfinished_requests():
                engine.step()
            results.append(tokens)
        else:
            results.append(llm.collective_rpc(phase["rpc"])[0])
    with open(out_path, "w", encoding="utf-8") as f:
        json.dump({"phases": results}, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
