"""Run vLLM's offline ``LLM`` in a fresh process and write what it produced as JSON.

Each run gets its own process because vLLM resolves its platform once per process: the same
script serves our plugin and, with ``VLLM_PLUGINS=none``, vLLM's native CPU backend (the
reference of the differential tests).

Usage: ``python tests/llm_harness.py SPEC.json OUT.json`` where SPEC holds
``{"model": str, "engine": {LLM kwargs}, "requests": [{"prompt" | "prompt_token_ids", "params":
{SamplingParams kwargs}}], "rpc": [worker method names called before and after generation],
"metrics": true for vLLM's counters after generation (needs ``"disable_log_stats": false``),
"rpc_workers": worker methods whose results from every worker are kept (pipeline stages),
a request's optional "lora": ``[name, id, path]`` (a ``LoRARequest``),
"rounds": how many times the requests are generated (outputs of all rounds, in order),
"batches": instead of "requests", request lists generated one after another by the same engine
(each list's outputs under "batches", all of them in order under "outputs"),
"embed_batches": instead of both, lists of ``{"prompt" | "prompt_token_ids", "params":
{PoolingParams kwargs}}`` embedded one list after another by ``LLM.embed`` (a pooling model),
or ``{"method": "classify" | "encode", "requests": [...], "task": pooling task of "encode"}``
(``LLM.classify``, ``LLM.encode``: ``"data"`` per request) or ``{"method": "score",
"query": str, "documents": [str]}`` (``LLM.score``); each one's result under
"embed_batches" as ``{"embeddings": [[float]], "num_tokens": [int]}``, ``{"probs":
[[float]], "num_tokens": [int]}``, ``{"scores": [float]}`` or ``{"error": "ExceptionType:
message"}`` when vLLM refused it}``.
Logprobs come back as ``[token_id, logprob, rank]`` lists, most likely first.
"""

from __future__ import annotations

import json
import os
import sys


def main(spec_path: str, out_path: str) -> None:
    with open(spec_path, encoding="utf-8") as f:
        spec = json.load(f)
    from vllm import LLM
    from vllm.platforms import current_platform

    llm = LLM(model=spec["model"], **spec.get("engine", {}))
    rpc = spec.get("rpc", [])
    before = {name: llm.collective_rpc(name)[0] for name in rpc}
    embedded = None
    if "embed_batches" in spec:
        batches = None
        outputs = []
        embedded = [_embed(llm, requests) for requests in spec["embed_batches"]]
    elif "batches" in spec:
        batches = [_generate(llm, requests, 1) for requests in spec["batches"]]
        outputs = [o for batch in batches for o in batch]
    else:
        batches = None
        outputs = _generate(llm, spec["requests"], spec.get("rounds", 1))
    _wait_for_finished_ids(llm, rpc)
    after = {name: llm.collective_rpc(name)[0] for name in rpc}
    out = {
        "platform": f"{type(current_platform).__module__}.{type(current_platform).__name__}",
        "outputs": outputs,
        "rpc_before": before,
        "rpc_after": after,
    }
    if batches is not None:
        out["batches"] = batches
    if embedded is not None:
        out["embed_batches"] = embedded
    if spec.get("rpc_workers"):
        out["rpc_workers"] = {name: llm.collective_rpc(name) for name in spec["rpc_workers"]}
    if spec.get("metrics"):
        out["metrics"] = _counters(llm)
    with open(out_path, "w", encoding="utf-8") as f:
        json.dump(out, f)
    llm.llm_engine.engine_core.shutdown()


def _generate(llm, requests: list[dict], rounds: int) -> list[dict]:
    """``requests`` generated ``rounds`` times in one ``LLM.generate`` call each; the outputs
    as JSON-ready dicts, in order."""
    from vllm import SamplingParams
    from vllm.lora.request import LoRARequest

    prompts, params, loras = [], [], []
    for req in requests:
        if "prompt_token_ids" in req:
            prompts.append({"prompt_token_ids": req["prompt_token_ids"]})
        else:
            prompts.append(req["prompt"])
        params.append(SamplingParams(**_params(req.get("params", {}))))
        loras.append(LoRARequest(*req["lora"]) if req.get("lora") else None)
    results = []
    for _ in range(rounds):
        results += llm.generate(prompts, params, use_tqdm=False,
                                lora_request=loras if any(loras) else None)
    outputs = []
    for res in results:
        completions = []
        for c in res.outputs:
            logprobs = None
            if c.logprobs is not None:
                logprobs = [_sorted_logprobs(step) for step in c.logprobs]
            completions.append({"token_ids": list(c.token_ids), "text": c.text,
                                "logprobs": logprobs, "finish_reason": c.finish_reason,
                                "stop_reason": c.stop_reason})
        prompt_logprobs = None
        if res.prompt_logprobs is not None:
            prompt_logprobs = [_sorted_logprobs(step) if step is not None else None
                               for step in res.prompt_logprobs]
        outputs.append({"prompt_token_ids": list(res.prompt_token_ids or []),
                        "completions": completions, "prompt_logprobs": prompt_logprobs})
    return outputs


def _embed(llm, batch: list[dict] | dict) -> dict:
    """One pooling call (``LLM.embed``, ``LLM.classify`` or ``LLM.score``, see the module
    docstring): its outputs and prompt lengths, or the error vLLM raised for the call."""
    from vllm import PoolingParams

    method = batch.get("method", "embed") if isinstance(batch, dict) else "embed"
    try:
        if method == "score":
            results = llm.score(batch["query"], batch["documents"], use_tqdm=False)
            return {"scores": [float(r.outputs.score) for r in results]}
        requests = batch["requests"] if isinstance(batch, dict) else batch
        prompts = [{"prompt_token_ids": r["prompt_token_ids"]} if "prompt_token_ids" in r
                   else r["prompt"] for r in requests]
        params = [PoolingParams(**r.get("params", {})) for r in requests]
        if method == "classify":
            results = llm.classify(prompts, pooling_params=params, use_tqdm=False)
            out = {"probs": [list(map(float, r.outputs.probs)) for r in results]}
        elif method == "encode":
            results = llm.encode(prompts, pooling_params=params, use_tqdm=False,
                                 pooling_task=batch["task"])
            out = {"data": [r.outputs.data.float().tolist() for r in results]}
        else:
            results = llm.embed(prompts, pooling_params=params, use_tqdm=False)
            out = {"embeddings": [list(map(float, r.outputs.embedding)) for r in results]}
    except Exception as e:  # the refusal is the result under test
        return {"error": f"{type(e).__name__}: {e}"}
    return {**out, "num_tokens": [len(r.prompt_token_ids) for r in results]}


def _wait_for_finished_ids(llm, rpc: list[str], timeout_s: float = 10.0) -> None:
    """Let the worker learn which requests finished before ``rpc_after`` is read.

    vLLM tells the worker about finished requests in the *next* ``SchedulerOutput``; the engine
    core runs that step right after the last output, but it first handles whatever client
    requests are queued (``EngineCore._process_input_queue``), so an RPC sent as soon as
    ``generate`` returns can overtake it and see the last requests still live. Poll until the
    runner holds no request; a runner that leaks state still reports it after ``timeout_s``.
    """
    import time

    if "runner_stats" not in rpc:
        return
    deadline = time.monotonic() + timeout_s
    while (llm.collective_rpc("runner_stats")[0].get("live_requests", 0)
           and time.monotonic() < deadline):
        time.sleep(0.05)


def _counters(llm) -> dict:
    """vLLM's counters (``LLM.get_metrics``) by name, summed over their label sets; the
    per-position vector (``..._per_pos``) as a list."""
    from vllm.v1.metrics.reader import Counter, Vector

    out: dict = {}
    for m in llm.get_metrics():
        if isinstance(m, Counter):
            out[m.name] = out.get(m.name, 0) + m.value
        elif isinstance(m, Vector):
            prev = out.get(m.name, [0] * len(m.values))
            out[m.name] = [a + b for a, b in zip(prev, m.values, strict=True)]
    return out


def _params(p: dict) -> dict:
    """JSON -> ``SamplingParams`` kwargs: int keys of ``logit_bias``, ``structured_outputs``
    as vLLM's ``StructuredOutputsParams``."""
    p = dict(p)
    if p.get("logit_bias") is not None:
        p["logit_bias"] = {int(k): float(v) for k, v in p["logit_bias"].items()}
    if p.get("structured_outputs") is not None:
        from vllm.sampling_params import StructuredOutputsParams

        p["structured_outputs"] = StructuredOutputsParams(**p["structured_outputs"])
    return p


def _sorted_logprobs(step) -> list[tuple[int, float, int]]:
    """One position's logprobs as ``(token_id, logprob, rank)``, most likely first."""
    return sorted(((int(t), float(lp.logprob), int(lp.rank)) for t, lp in step.items()),
                  key=lambda x: -x[1])


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
    # The output is written and the engine stopped: skip interpreter finalisation, where a
    # vLLM client thread still freeing pooling outputs (torch.frombuffer tensors, whose
    # deleter takes the GIL) is ended inside torch's deleter: std::terminate, SIGABRT, on
    # vLLM's own CPU backend as on ours.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
