"""Abort a request while its drafts await verification; report the KV blocks before and after.

Runs vLLM's ``LLMEngine`` in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so the
scheduler's block pool and the runner can be read. Usage: ``python tests/spec_abort_harness.py
MODEL OUT.json [SPEC_JSON]`` (default: ngram, k = 4). Prints nothing; writes
``{"free_before", "free_after", "aborted_with_drafts", "live_requests", "outputs"}``.
"""

from __future__ import annotations

import json
import os
import sys

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
         "prompt_lookup_max": 3}


def main(model: str, out_path: str, spec: dict | None = None) -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import EngineArgs, LLMEngine, SamplingParams

    engine = LLMEngine.from_engine_args(EngineArgs(
        model=model, dtype="float32", max_model_len=256, kv_cache_memory_bytes=64 * 2**20,
        seed=0, speculative_config=spec or NGRAM))
    scheduler = engine.engine_core.engine_core.scheduler
    pool = scheduler.kv_cache_manager.block_pool
    free_before = pool.get_num_free_blocks()
    block = [101 + 37 * i for i in range(9)]
    params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    for name, prompt in (("victim", block * 4), ("other", block[::-1] * 3)):
        engine.add_request(name, {"prompt_token_ids": prompt}, params)
    aborted_with_drafts = 0
    outputs: dict[str, list[int]] = {}
    for _ in range(200):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            outputs[out.request_id] = list(out.outputs[0].token_ids)
        victim = [r for r in scheduler.requests.values() if r.request_id.startswith("victim")]
        if victim and not aborted_with_drafts and victim[0].spec_token_ids \
                and victim[0].num_output_tokens > 8:
            aborted_with_drafts = len(victim[0].spec_token_ids)
            engine.abort_request(["victim"])
    for _ in range(3):  # the finished ids reach the worker with the next (empty) steps
        engine.step()
    stats = engine.collective_rpc("runner_stats")[0]
    with open(out_path, "w", encoding="utf-8") as f:
        json.dump({"free_before": free_before, "free_after": pool.get_num_free_blocks(),
                   "aborted_with_drafts": aborted_with_drafts,
                   "live_requests": stats["live_requests"], "outputs": outputs,
                   "spec_draft_tokens": stats["spec_draft_tokens"],
                   "draft_tracked_requests": stats.get("draft_tracked_requests")}, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], json.loads(sys.argv[3]) if len(sys.argv) > 3 else None)
