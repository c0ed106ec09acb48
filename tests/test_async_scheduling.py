"""Asynchronous scheduling: steps queued with ``mx.async_eval``, tokens fed on the device.

Unit parts check the pending-token layout and the output future; the end-to-end test runs the
same mixed requests with vLLM's ``async_scheduling`` on and off and wants identical outputs.
"""

from __future__ import annotations

from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest
from conftest import run_llm
from test_e2e_offline import _engine, _prompts

from vllm_unified.worker.async_output import MLXAsyncOutput, feed_pending
from vllm_unified.worker.input_batch import InputBatch, RequestState


class _Out:
    """The part of ``SchedulerOutput`` that ``InputBatch.layout`` reads."""

    def __init__(self, num_scheduled_tokens: dict[str, int]) -> None:
        self.num_scheduled_tokens = num_scheduled_tokens


def _state(req_id: str, tokens: list[int], prompt: int, computed: int, pending=None):
    s = RequestState(req_id=req_id, token_ids=list(tokens), num_prompt_tokens=prompt,
                     block_ids=[1, 2], num_computed_tokens=computed, sampling_params=None)
    s.pending = pending
    return s


def test_layout_feeds_pending_tokens_from_the_device():
    prev = mx.array([111, 222, 333], dtype=mx.uint32)  # an earlier step's sampled tokens
    batch = InputBatch()
    # "a": decode whose last token is pending (index 2 of prev); "b": a prefill chunk;
    # "c": decode whose last token is known on the host.
    batch.requests = {
        "a": _state("a", [5, 6, 7], 3, 3, pending=(prev, 2)),
        "b": _state("b", [8, 9, 10, 11], 4, 1),
        "c": _state("c", [12, 13, 14], 2, 2),
    }
    step = batch.layout(_Out({"a": 1, "b": 3, "c": 1}))
    assert step.input_ids.tolist() == [0, 9, 10, 11, 14]  # placeholder at row 0
    assert step.sample_req_idx == [0, 1, 2]
    assert [(row, ref[1]) for row, ref in step.pending_rows] == [(0, 2)]
    ids = feed_pending(mx.array(step.input_ids), step.pending_rows)
    assert ids.tolist() == [333, 9, 10, 11, 14]
    assert ids.dtype == mx.int32


def test_layout_refuses_tokens_beyond_the_pending_one():
    batch = InputBatch()
    batch.requests = {"a": _state("a", [5, 6, 7], 3, 3, pending=None)}
    with pytest.raises(RuntimeError, match="only 3 tokens are known"):
        batch.layout(_Out({"a": 1}))


def test_resumed_request_drops_its_pending_token():
    s = _state("a", [5, 6, 7], 2, 3, pending=(mx.array([1]), 0))
    s.set_tokens([5, 6, 7, 8])
    assert s.pending is None and s.output_token_ids == [7, 8]


def test_async_output_resolves_once():
    calls = []
    out = MLXAsyncOutput(lambda: calls.append(1) or "output")
    assert not out.resolved
    assert out.resolve() == "output" and out.get_output() == "output"
    assert calls == [1] and out.resolved


def test_feed_pending_groups_by_source_array():
    a, b = mx.array([1, 2], dtype=mx.uint32), mx.array([30, 40], dtype=mx.uint32)
    ids = feed_pending(mx.zeros((4,), dtype=mx.int32),
                       [(3, (a, 0)), (0, (b, 1)), (1, (a, 1))])
    assert np.array(ids).tolist() == [40, 2, 0, 1]


@pytest.mark.engine
def test_async_and_sync_scheduling_give_the_same_outputs(tiny_llama, tmp_path, monkeypatch):
    """Greedy requests finishing at different steps, a seeded sampled one (MLX sampler), one
    with a repetition penalty and one with logprobs (vLLM's sampler: those steps are waited for
    and must see every earlier token) and a long prompt that is chunked: identical outputs,
    also with the queued steps evaluated on the encode thread (the CUDA default, forced on
    here)."""
    prompts = _prompts(6, [9, 40, 150, 17, 64, 5], vocab=49152, seed=7)
    params = [
        {"temperature": 0.0, "max_tokens": 6, "ignore_eos": True},
        {"temperature": 0.0, "max_tokens": 16, "ignore_eos": True},
        {"temperature": 0.0, "max_tokens": 11, "ignore_eos": True},
        {"temperature": 0.8, "seed": 3, "max_tokens": 13, "ignore_eos": True},
        {"temperature": 0.0, "max_tokens": 9, "ignore_eos": True, "repetition_penalty": 1.3},
        {"temperature": 0.0, "max_tokens": 8, "ignore_eos": True, "logprobs": 2},
    ]
    requests = [{"prompt_token_ids": p, "params": q} for p, q in zip(prompts, params,
                                                                    strict=True)]
    base = _engine(dtype="float32", max_num_batched_tokens=64)
    (tmp_path / "async").mkdir()
    (tmp_path / "sync").mkdir()
    queued = run_llm({"model": tiny_llama, "engine": {**base, "async_scheduling": True},
                      "requests": requests, "rpc": ["runner_stats"]}, tmp_path / "async")
    waited = run_llm({"model": tiny_llama, "engine": {**base, "async_scheduling": False},
                      "requests": requests}, tmp_path / "sync")
    (tmp_path / "thread").mkdir()
    monkeypatch.setenv("VLLM_UNIFIED_ENCODE_THREAD", "1")
    threaded = run_llm({"model": tiny_llama, "engine": {**base, "async_scheduling": True},
                        "requests": requests, "rpc": ["runner_stats"]}, tmp_path / "thread")
    for i, (a, s) in enumerate(zip(queued["outputs"], waited["outputs"], strict=True)):
        assert a["completions"][0]["token_ids"] == s["completions"][0]["token_ids"], i
        assert len(a["completions"][0]["token_ids"]) == params[i]["max_tokens"]
        assert threaded["outputs"][i]["completions"][0]["token_ids"] == \
            s["completions"][0]["token_ids"], i
    assert queued["rpc_after"]["runner_stats"]["encode_thread_s"] == 0.0  # CPU default: off
    assert threaded["rpc_after"]["runner_stats"]["encode_thread_s"] > 0.0
    lp_async = queued["outputs"][5]["completions"][0]["logprobs"]
    lp_sync = waited["outputs"][5]["completions"][0]["logprobs"]
    assert [[t for t, _, _ in step] for step in lp_async] == \
        [[t for t, _, _ in step] for step in lp_sync]
    stats = queued["rpc_after"]["runner_stats"]
    assert stats["sampled_by_vllm"] > 0  # the penalty/logprobs requests took the waited path
    assert stats["decode_steps"] > 0


def _step(**changes) -> SimpleNamespace:
    """A scheduler output of a pure-decode step of two requests (the fields the runner's
    build-alongside rule reads), with ``changes`` applied."""
    so = SimpleNamespace(
        total_num_scheduled_tokens=2, num_scheduled_tokens={"a": 1, "b": 1},
        scheduled_new_reqs=[], scheduled_cached_reqs=SimpleNamespace(resumed_req_ids=set()),
        new_block_ids_to_zero=None, scheduled_spec_decode_tokens={},
        has_structured_output_requests=False, preempted_req_ids=None)
    vars(so).update(changes)
    return so


def _runner(**changes) -> SimpleNamespace:
    runner = SimpleNamespace(encoder=object(), build_alongside=True, compiled_decode=object(),
                             spec=None, draft=None, page_release=None,
                             kv_connector=SimpleNamespace(enabled=False),
                             stage=SimpleNamespace(size=1))
    vars(runner).update(changes)
    return runner


@pytest.mark.parametrize("runner,step", [
    ({}, {"total_num_scheduled_tokens": 3, "num_scheduled_tokens": {"a": 1, "b": 2}}),
    ({}, {"total_num_scheduled_tokens": 0, "num_scheduled_tokens": {}}),
    ({}, {"scheduled_new_reqs": [object()]}),
    ({}, {"scheduled_cached_reqs": SimpleNamespace(resumed_req_ids={"a"})}),
    ({}, {"new_block_ids_to_zero": [3]}),
    ({}, {"scheduled_spec_decode_tokens": {"a": [5]}}),
    ({}, {"has_structured_output_requests": True}),
    ({}, {"preempted_req_ids": {"b"}}),
    ({"encoder": None}, {}),
    ({"build_alongside": False}, {}),
    ({"compiled_decode": None}, {}),  # the plain forward assigns into the pool's arrays
    ({"spec": object()}, {}),
    ({"draft": object()}, {}),
    ({"page_release": object()}, {}),
    ({"kv_connector": SimpleNamespace(enabled=True)}, {}),
    ({"stage": SimpleNamespace(size=2)}, {}),
])
def test_only_compiled_pure_decode_steps_build_alongside(runner, step):
    """What may be built while the encode thread still encodes the previous step: a
    compiled pure-decode step with nothing that touches the pool before its forward."""
    from vllm_unified.worker.model_runner import MLXModelRunner

    rule = MLXModelRunner._builds_alongside_queued_step
    assert rule(_runner(), _step()) is True
    assert rule(_runner(**runner), _step(**step)) is False


@pytest.mark.parametrize("write_path,hybrid,pure_decode,async_scheduling,waits", [
    ("metal_kernel", False, False, True, True),   # prefill chunks: ids known on the host
    ("metal_kernel", True, True, True, True),     # a recurrent layer's state write
    ("metal_kernel", False, True, True, False),   # chained through the sampled tokens
    ("metal_kernel", False, False, False, False),  # every step evaluated before the next
    ("cuda_kernel", True, False, True, False),    # CUDA: one stream, in order
    ("native_rows", False, False, True, False),
])
def test_metal_steps_wait_where_no_data_path_orders_them(write_path, hybrid, pure_decode,
                                                         async_scheduling, waits):
    """On Metal with asynchronous scheduling, a step that may read pages the previous step
    wrote without a data path from that write waits for the device first."""
    from vllm_unified.worker.model_runner import MLXModelRunner

    runner = SimpleNamespace(async_scheduling=async_scheduling, kv_cache=SimpleNamespace(
        pool=SimpleNamespace(write_path=write_path), store=object() if hybrid else None))
    assert MLXModelRunner._waits_for_previous_step(runner, pure_decode) is waits
