"""Speculative decoding (``--speculative-config``): vLLM's proposers and rejection sampler on the
MLX runner.

Unit parts: the verification metadata equals vLLM's GPU runner's, the step layout feeds drafts
after the known tokens, all-accepted / all-rejected drafts through vLLM's rejection sampler,
logprobs re-indexed by request. End to end (tiny random Llama, fp32): greedy outputs with
``ngram`` equal those without speculation, batched with chunked prefill and with preemption;
seeded random sampling reproducible whatever shares the batch; a chi-square test that the
verified tokens follow the target model's distribution; an abort during verification frees
every block.
"""

from __future__ import annotations

import json
import types

import numpy as np
import pytest
import torch
from conftest import run_llm
from test_e2e_offline import _engine, _prompts

from vllm_unified import compat
from vllm_unified.worker.input_batch import InputBatch, RequestState
from vllm_unified.worker.spec_decode import logprobs_for_requests, spec_decode_metadata

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
         "prompt_lookup_max": 3}


# ------------------------------------------------------------------------------ unit parts
def _vllm_metadata(num_draft: list[int], input_ids: list[int]):
    """vLLM's own ``GPUModelRunner._calc_spec_decode_metadata`` on CPU tensors, for a batch
    of decode requests (query length d + 1 each, every request sampling)."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    fake = types.SimpleNamespace(
        arange_np=np.arange(1024), _arange_scratch=np.empty(1024, dtype=np.int64),
        device=torch.device("cpu"),
        input_ids=types.SimpleNamespace(gpu=torch.tensor(input_ids, dtype=torch.int32)))
    fake._get_cumsum_and_arange = types.MethodType(GPUModelRunner._get_cumsum_and_arange, fake)
    cu = np.cumsum(np.asarray(num_draft) + 1).astype(np.int32)
    return GPUModelRunner._calc_spec_decode_metadata(fake, np.asarray(num_draft, np.int32), cu)


@pytest.mark.parametrize("num_draft", [[3, 0, 2, 0, 1], [0, 0], [4], [1, 4, 4, 0]])
def test_metadata_equals_vllms(num_draft):
    rng = np.random.default_rng(0)
    input_ids = rng.integers(0, 1000, size=sum(d + 1 for d in num_draft)).tolist()
    # drafts: every token of a request after its first (the last known token)
    starts = np.cumsum([0] + [d + 1 for d in num_draft])[:-1]
    drafts = [t for s, d in zip(starts, num_draft, strict=True) for t in input_ids[s + 1:s + 1 + d]]
    ours, ref = spec_decode_metadata(num_draft, drafts), _vllm_metadata(num_draft, input_ids)
    assert ours.num_draft_tokens == ref.num_draft_tokens
    for name in ("draft_token_ids", "cu_num_draft_tokens", "cu_num_sampled_tokens",
                 "target_logits_indices", "bonus_logits_indices", "logits_indices"):
        assert getattr(ours, name).tolist() == getattr(ref, name).tolist(), name


def test_metadata_refuses_a_wrong_draft_count():
    with pytest.raises(ValueError, match="3 draft tokens"):
        spec_decode_metadata([1, 1], [5, 6, 7])


class _Out:
    def __init__(self, num_scheduled_tokens, spec=None):
        self.num_scheduled_tokens = num_scheduled_tokens
        self.scheduled_spec_decode_tokens = spec or {}


def _state(req_id, tokens, prompt, computed):
    return RequestState(req_id=req_id, token_ids=list(tokens), num_prompt_tokens=prompt,
                        block_ids=[1, 2], num_computed_tokens=computed, sampling_params=None)


def test_layout_feeds_drafts_after_the_known_tokens():
    batch = InputBatch()
    batch.requests = {"a": _state("a", [5, 6, 7], 2, 2),   # decode + 2 drafts
                      "b": _state("b", [8, 9, 10, 11], 4, 1),  # prefill chunk
                      "c": _state("c", [12, 13], 1, 1)}    # decode, no drafts
    step = batch.layout(_Out({"a": 3, "b": 2, "c": 1}, {"a": [70, 71]}))
    assert step.input_ids.tolist() == [7, 70, 71, 9, 10, 13]
    assert step.sample_req_idx == [0, 2]  # "b" stops short of its known tokens
    assert step.num_draft_tokens.tolist() == [2, 0, 0]
    assert step.draft_token_ids == [70, 71]
    assert step.seq_lens.tolist() == [5, 3, 2]


def test_layout_refuses_drafts_that_do_not_follow_the_known_tokens():
    batch = InputBatch()
    batch.requests = {"a": _state("a", [5, 6, 7, 8], 2, 1)}
    with pytest.raises(RuntimeError, match="draft tokens scheduled after token 3"):
        batch.layout(_Out({"a": 3}, {"a": [70]}))
    with pytest.raises(RuntimeError, match="only 4 tokens are known"):
        batch.layout(_Out({"a": 5}, {"a": [70]}))


def _decoder(monkeypatch_free_config=None):
    """A SpecDecoder with vLLM's config for ngram k=4 (no model needed)."""
    from vllm_unified.worker.spec_decode import SpecDecoder

    compat.register_rejection_sampler_kernels()
    spec = types.SimpleNamespace(method="ngram", num_speculative_tokens=4, prompt_lookup_min=2,
                                 prompt_lookup_max=3, rejection_sample_method="standard")
    config = types.SimpleNamespace(
        speculative_config=spec, model_config=types.SimpleNamespace(max_model_len=64),
        scheduler_config=types.SimpleNamespace(max_num_seqs=4),
        parallel_config=types.SimpleNamespace(tensor_parallel_size=1))
    return SpecDecoder(config, compat.Sampler())


def _greedy_metadata(n, temperature=None, generators=None):
    from vllm.v1.sample.logits_processor import LogitsProcessors

    greedy = temperature is None
    return compat.SamplingMetadata(
        temperature=None if greedy else torch.tensor(temperature, dtype=torch.float32),
        all_greedy=greedy, all_random=not greedy, top_p=None, top_k=None,
        generators=generators or {}, max_num_logprobs=None, no_penalties=True,
        prompt_token_ids=None, frequency_penalties=torch.zeros(n),
        presence_penalties=torch.zeros(n), repetition_penalties=torch.ones(n),
        output_token_ids=[[] for _ in range(n)], allowed_token_ids_mask=None,
        bad_words_token_ids={}, logitsprocs=LogitsProcessors())


def test_all_accepted_and_all_rejected_drafts():
    """Request 0's drafts are the target's argmax at every row (all accepted + bonus); request
    1's first draft already disagrees (one recovered token); request 2 has none."""
    dec = _decoder()
    vocab = 16
    logits = torch.full((4 + 1 + 3 + 1 + 1, vocab), -5.0)
    targets0 = [3, 4, 5, 6, 7]  # argmax after the last token and after each draft
    for r, t in enumerate(targets0):
        logits[r, t] = 5.0
    logits[5, 9] = 5.0   # request 1 row 0: target 9, draft 1 -> rejected
    logits[6, 2] = 5.0
    logits[7, 2] = 5.0
    logits[8, 2] = 5.0
    logits[9, 11] = 5.0  # request 2: plain bonus token
    out = dec.sample(logits, [4, 3, 0], [3, 4, 5, 6, 1, 2, 2], _greedy_metadata(3), vocab)
    assert out.token_ids == [[3, 4, 5, 6, 7], [9], [11]]
    assert dec.stats() == {"spec_drafts": 2, "spec_draft_tokens": 7, "spec_accepted_tokens": 4}


def test_logprobs_are_indexed_by_scheduled_request():
    lists = compat.LogprobsLists(np.arange(6)[:, None], np.zeros((6, 1)), np.zeros(6),
                                 [0, 2, 6])
    out = logprobs_for_requests(lists, rows=[1, 3], counts=[2, 4], num_reqs=4)
    assert out.cu_num_generated_tokens == [0, 0, 2, 2, 6]
    assert out.slice_request(3, 4).logprob_token_ids[:, 0].tolist() == [2, 3, 4, 5]
    assert out.slice_request(1, 2).logprob_token_ids[:, 0].tolist() == [0, 1]


def test_proposals_are_handed_over_once():
    dec = _decoder()
    states = [_state("a", [1, 2, 3, 1, 2, 3, 1, 2], 8, 7), _state("b", [4, 5, 6], 3, 1)]
    dec.propose(states, [[2], []])
    drafts = dec.take()
    assert drafts.req_ids == ["a", "b"]
    # vLLM's n-gram match: "3 1 2" recurs; what followed it, up to the context's end.
    # b sampled nothing (a prefill chunk): no proposal.
    assert drafts.draft_token_ids == [[3, 1, 2], []]
    assert dec.take() is None


# ------------------------------------------------------------------------------ end to end
def _repetitive(n: int, seed: int) -> list[list[int]]:
    """Prompts that repeat a random block (n-grams to match) of different lengths."""
    blocks = _prompts(n, [7, 11, 23, 40, 5, 60, 13, 31][:n], vocab=49152, seed=seed)
    return [b * (3 + i % 3) for i, b in enumerate(blocks)]


def _ids(result):
    return [o["completions"][0]["token_ids"] for o in result["outputs"]]


@pytest.mark.slow
def test_greedy_ngram_equals_no_speculation(tiny_llama, tmp_path):
    """8 requests (repetitive and random prompts, up to 240 tokens, chunked by a 64-token
    budget), greedy with a repetition penalty on one and logprobs on another: identical token
    ids with and without ngram speculation, drafts proposed and accepted, logprobs equal."""
    prompts = _repetitive(6, seed=11) + _prompts(2, [50, 9], vocab=49152, seed=12)
    params = [{"temperature": 0.0, "max_tokens": 24 + 3 * i, "ignore_eos": True}
              for i in range(8)]
    params[2]["repetition_penalty"] = 1.2
    params[5]["logprobs"] = 2
    requests = [{"prompt_token_ids": p, "params": q} for p, q in zip(prompts, params,
                                                                    strict=True)]
    base = _engine(dtype="float32", max_num_batched_tokens=64)
    (tmp_path / "plain").mkdir()
    (tmp_path / "spec").mkdir()
    plain = run_llm({"model": tiny_llama, "engine": base, "requests": requests},
                    tmp_path / "plain")
    spec = run_llm({"model": tiny_llama, "engine": {**base, "speculative_config": NGRAM},
                    "requests": requests, "rpc": ["runner_stats"]}, tmp_path / "spec")
    assert _ids(spec) == _ids(plain)
    stats = spec["rpc_after"]["runner_stats"]
    assert stats["spec_draft_tokens"] > 0 and stats["spec_accepted_tokens"] > 0
    assert stats["spec_accepted_tokens"] < stats["spec_draft_tokens"]  # some were rejected
    assert stats["forwards"] < sum(p["max_tokens"] for p in params)
    assert stats["live_requests"] == 0
    lp_plain = plain["outputs"][5]["completions"][0]["logprobs"]
    lp_spec = spec["outputs"][5]["completions"][0]["logprobs"]
    assert len(lp_spec) == params[5]["max_tokens"]
    for a, b in zip(lp_plain, lp_spec, strict=True):
        assert [t for t, _, _ in a] == [t for t, _, _ in b]
        np.testing.assert_allclose([lp for _, lp, _ in a], [lp for _, lp, _ in b], atol=1e-4)
    assert "speculative decoding, method ngram, k = 4" in spec["log"]


@pytest.mark.slow
def test_greedy_ngram_with_preemption(tiny_llama, tmp_path):
    """Too few KV blocks: vLLM preempts and resumes requests mid-speculation; same tokens."""
    prompts = _repetitive(6, seed=5)
    requests = [{"prompt_token_ids": p[:60], "params": {"temperature": 0.0, "max_tokens": 40,
                                                        "ignore_eos": True}} for p in prompts]
    base = _engine(dtype="float32", max_model_len=128)
    (tmp_path / "plain").mkdir()
    (tmp_path / "tight").mkdir()
    plain = run_llm({"model": tiny_llama, "engine": base, "requests": requests},
                    tmp_path / "plain")
    tight = run_llm({"model": tiny_llama,
                     "engine": {**base, "num_gpu_blocks_override": 14,
                                "speculative_config": NGRAM},
                     "requests": requests, "rpc": ["runner_stats"]}, tmp_path / "tight")
    stats = tight["rpc_after"]["runner_stats"]
    assert stats["resumed"] > 0, "no request was preempted"
    assert stats["spec_draft_tokens"] > 0
    assert _ids(tight) == _ids(plain)


@pytest.mark.slow
def test_abort_during_verification_frees_blocks(tiny_llama, tmp_path):
    """A request aborted while its drafts are scheduled for verification: every KV block is
    free again, the runner holds no request, the other request finishes all its tokens."""
    import subprocess
    import sys

    from conftest import TESTS

    out = tmp_path / "abort.json"
    proc = subprocess.run([sys.executable, str(TESTS / "spec_abort_harness.py"), tiny_llama,
                           str(out)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
    result = json.loads(out.read_text())
    assert result["aborted_with_drafts"] > 0, "the victim had no drafts when aborted"
    assert result["free_after"] == result["free_before"]
    assert result["live_requests"] == 0
    assert len(result["outputs"]["other"]) == 60
    assert len(result["outputs"].get("victim", [])) < 60
