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
import math
import types
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import run_llm
from test_e2e_offline import _engine, _prompts

from vllm_unified import compat, patches
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


def _state(req_id, tokens, prompt, computed, sampling_type=None):
    params = types.SimpleNamespace(sampling_type=sampling_type or compat.SamplingType.GREEDY)
    return RequestState(req_id=req_id, token_ids=list(tokens), num_prompt_tokens=prompt,
                        block_ids=[1, 2], num_computed_tokens=computed, sampling_params=params)


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


def _decoder(**spec_fields):
    """A SpecDecoder with vLLM's config for ngram k=4 (no model needed); ``spec_fields`` set
    more ``SpeculativeConfig`` fields."""
    from vllm_unified.worker.spec_decode import SpecDecoder

    patches.route_rejection_sampler_kernels()
    spec = types.SimpleNamespace(method="ngram", num_speculative_tokens=4, prompt_lookup_min=2,
                                 prompt_lookup_max=3, rejection_sample_method="standard",
                                 **spec_fields)
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
    stats = dec.stats()
    assert {k: stats[k] for k in ("spec_drafts", "spec_draft_tokens", "spec_accepted_tokens")
            } == {"spec_drafts": 2, "spec_draft_tokens": 7, "spec_accepted_tokens": 4}
    # the budget's acceptance counts (weights decay slowly): positions 1-3 drafted twice and
    # accepted once, position 4 drafted and accepted once
    acc = dec.budget.acceptance
    assert acc.drafted.tolist() == pytest.approx([2, 2, 2, 1], rel=1e-2)
    assert acc.accepted.tolist() == pytest.approx([1, 1, 1, 1], rel=1e-2)


def test_random_drafts_the_target_is_sure_of_are_accepted():
    """Temperature 1, target certain of each draft: all accepted plus the bonus token. With
    vLLM 0.32's own CPU stand-in for the expand kernel the temperatures were never written
    and this returned a single arbitrary token."""
    dec = _decoder()
    logits = torch.full((3, 8), -10.0)
    logits[0, 3], logits[1, 4], logits[2, 5] = 10.0, 10.0, 10.0
    out = dec.sample(logits, [2], [3, 4], _greedy_metadata(1, temperature=[1.0]), 8)
    assert out.token_ids == [[3, 4, 5]]


def test_expand_kernel_writes_the_output_in_its_dtype():
    from vllm.utils import cpu_triton_utils

    cu = torch.tensor([2, 2, 5], dtype=torch.int32)
    for values, dtype in ((torch.tensor([0.5, 0.0, 2.0]), torch.float32),
                          (torch.tensor([7, 0, 9], dtype=torch.int32), torch.int32)):
        out = torch.full((5,), -3, dtype=dtype)
        patches.expand_kernel_cpu(out, values, cu, 0, 1)
        assert out.tolist() == [values[0].item()] * 2 + [values[2].item()] * 3
    # vLLM 0.32's stand-in leaves a float32 output unwritten (why ours is registered); when
    # this starts failing, vLLM fixed it and the patch can go.
    import vllm._C  # noqa: F401

    out = torch.full((5,), -3.0)
    cpu_triton_utils._expand_kernel_impl(out, torch.tensor([0.5, 0.0, 2.0]), cu, 0, 1)
    assert out.tolist() == [-3.0] * 5


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


def test_draft_budget_policy_and_its_log_words(monkeypatch):
    """Adaptive by default; ``VLLM_UNIFIED_SPEC_BUDGET=0`` off; a user's
    ``num_speculative_tokens_per_batch_size`` wins over both."""
    from vllm_unified import envs

    dec = _decoder()
    assert dec.policy == "adaptive" and dec.budget is not None
    assert "k = 4 draft tokens per step; draft budget adaptive" in dec.describe()
    monkeypatch.setenv(envs.SPEC_BUDGET_ENV, "0")
    dec = _decoder()
    assert dec.policy == "off" and dec.budget is None
    assert "draft budget off (VLLM_UNIFIED_SPEC_BUDGET=0)" in dec.describe()
    monkeypatch.setenv(envs.SPEC_BUDGET_ENV, "1")
    dec = _decoder(num_speculative_tokens_per_batch_size=[(1, 4, 2), (5, 8, 0)])
    assert dec.policy == "schedule" and dec.budget is None
    assert "num_speculative_tokens_per_batch_size [(1, 4, 2), (5, 8, 0)]" in dec.describe()


def test_proposals_are_capped_by_vllms_count_and_by_the_budget(monkeypatch):
    """The step's ``num_spec_tokens_to_schedule`` bounds every proposal; the adaptive budget,
    once it has measured compute-bound steps, withholds the drafts (counted), except for its
    probes; the budget off hands them all."""
    from vllm_unified import envs

    def states():
        return [_state(r, [1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2], 12, 11) for r in "abcd"]

    dec = _decoder()
    dec.propose(states(), [[2]] * 4, 2)
    assert dec.take().draft_token_ids == [[3, 4]] * 4
    dec.propose(states(), [[2]] * 4, 0)
    assert dec.take().draft_token_ids == [[]] * 4
    for n in [4, 20] * 8:  # 4 streams, 10 ms a row, nothing fixed: drafts never pay
        dec.budget.observe_step(n, 0.01 * n)
    handed = []
    for _ in range(32):
        dec.propose(states(), [[2]] * 4)
        handed.append(sum(len(d) for d in dec.take().draft_token_ids))
    assert sorted(set(handed)) == [0, 4]  # one request's 4 drafts every 16th step
    stats = dec.stats()
    assert stats["spec_handed_tokens"] == 8 + sum(handed)
    assert stats["spec_withheld_tokens"] == 32 * 16 - sum(handed)
    assert stats["spec_policy"] == "adaptive" and stats["spec_budget_last_cap"] == 0
    # a seeded request keeps all its drafts (which random numbers it draws depends on them)
    mixed = states()
    mixed[1] = _state("b", mixed[1].token_ids, 12, 11, compat.SamplingType.RANDOM_SEED)
    for _ in range(3):
        dec.propose(mixed, [[2]] * 4)
        drafts = dec.take().draft_token_ids
        assert drafts[1] == [3, 4, 5, 1] and drafts[0] == drafts[2] == drafts[3] == []
    monkeypatch.setenv(envs.SPEC_BUDGET_ENV, "0")
    off = _decoder()
    off.propose(states(), [[2]] * 4)
    assert off.take().draft_token_ids == [[3, 4, 5, 1]] * 4
    assert off.stats()["spec_withheld_tokens"] == 0


# ------------------------------------------------------------------------------ end to end
def _repetitive(n: int, seed: int) -> list[list[int]]:
    """Prompts that repeat a random block (n-grams to match) of different lengths."""
    blocks = _prompts(n, [7, 11, 23, 40, 5, 60, 13, 31][:n], vocab=49152, seed=seed)
    return [b * (3 + i % 3) for i, b in enumerate(blocks)]


def _ids(result):
    return [o["completions"][0]["token_ids"] for o in result["outputs"]]


def _ngram_requests() -> list[dict]:
    """8 greedy requests (repetitive and random prompts, up to 240 tokens), a repetition
    penalty on the third and logprobs on the sixth."""
    prompts = _repetitive(6, seed=11) + _prompts(2, [50, 9], vocab=49152, seed=12)
    params = [{"temperature": 0.0, "max_tokens": 24 + 3 * i, "ignore_eos": True}
              for i in range(8)]
    params[2]["repetition_penalty"] = 1.2
    params[5]["logprobs"] = 2
    return [{"prompt_token_ids": p, "params": q} for p, q in zip(prompts, params, strict=True)]


def _draft_requests() -> list[dict]:
    """6 greedy requests (repetitive and random prompts) for the draft-model runs."""
    prompts = _repetitive(4, seed=21) + _prompts(2, [70, 9], vocab=49152, seed=22)
    params = [{"temperature": 0.0, "max_tokens": 20 + 3 * i, "ignore_eos": True}
              for i in range(6)]
    return [{"prompt_token_ids": p, "params": q} for p, q in zip(prompts, params, strict=True)]


#: the engine of the greedy equality tests: fp32, a 64-token step budget (prompts chunked)
GREEDY_BASE = _engine(dtype="float32", max_num_batched_tokens=64)


@pytest.fixture(scope="module")
def plain_tiny(tiny_llama, tmp_path_factory) -> dict[str, dict]:
    """The greedy equality tests' requests without speculation, on one engine (``GREEDY_BASE``)
    generating the ngram test's requests, then the draft-model test's: each as a
    ``run_llm``-like result (``{"outputs": [...]}``) under ``"ngram"`` and ``"draft"``."""
    out = run_llm({"model": tiny_llama, "engine": GREEDY_BASE,
                   "batches": [_ngram_requests(), _draft_requests()]},
                  tmp_path_factory.mktemp("plain"))
    return {"ngram": {"outputs": out["batches"][0]}, "draft": {"outputs": out["batches"][1]}}


@pytest.mark.engine
def test_greedy_ngram_equals_no_speculation(tiny_llama, plain_tiny, tmp_path):
    """8 requests (repetitive and random prompts, up to 240 tokens, chunked by a 64-token
    budget), greedy with a repetition penalty on one and logprobs on another: identical token
    ids with and without ngram speculation, drafts proposed and accepted, logprobs equal.

    The adaptive draft budget (on by default) withheld drafts on some steps (its cold start
    alone does), and vLLM's ``vllm:spec_decode_*`` counters equal the runner's: they count
    the drafts that were handed. With vLLM's ``num_speculative_tokens_per_batch_size``
    (2 drafts at every batch size) no verification has more than 2 drafts, the same ids."""
    requests = _ngram_requests()
    params = [r["params"] for r in requests]
    base = GREEDY_BASE
    for name in ("spec", "schedule"):
        (tmp_path / name).mkdir()
    plain = plain_tiny["ngram"]
    spec = run_llm({"model": tiny_llama,
                    "engine": {**base, "speculative_config": NGRAM, "disable_log_stats": False},
                    "requests": requests, "rpc": ["runner_stats"], "metrics": True},
                   tmp_path / "spec")
    assert _ids(spec) == _ids(plain)
    stats = spec["rpc_after"]["runner_stats"]
    assert stats["spec_draft_tokens"] > 0 and stats["spec_accepted_tokens"] > 0
    assert stats["spec_accepted_tokens"] < stats["spec_draft_tokens"]  # some were rejected
    assert stats["forwards"] < sum(p["max_tokens"] for p in params)
    assert stats["live_requests"] == 0
    assert stats["spec_policy"] == "adaptive" and stats["spec_withheld_tokens"] > 0, stats
    assert stats["spec_budget_low_probes"] > 0 and stats["spec_budget_steps_measured"] > 0
    metrics = spec["metrics"]
    assert metrics["vllm:spec_decode_num_drafts"] == stats["spec_drafts"]
    assert metrics["vllm:spec_decode_num_draft_tokens"] == stats["spec_draft_tokens"]
    assert metrics["vllm:spec_decode_num_accepted_tokens"] == stats["spec_accepted_tokens"]
    per_pos = metrics["vllm:spec_decode_num_accepted_tokens_per_pos"]
    assert len(per_pos) == 4 and sum(per_pos) == stats["spec_accepted_tokens"]
    lp_plain = plain["outputs"][5]["completions"][0]["logprobs"]
    lp_spec = spec["outputs"][5]["completions"][0]["logprobs"]
    assert len(lp_spec) == params[5]["max_tokens"]
    for a, b in zip(lp_plain, lp_spec, strict=True):
        assert [t for t, _, _ in a] == [t for t, _, _ in b]
        np.testing.assert_allclose([lp for _, lp, _ in a], [lp for _, lp, _ in b], atol=1e-4)
    assert "speculative decoding, method ngram, k = 4" in spec["log"]
    assert "draft budget adaptive" in spec["log"]

    schedule = {**NGRAM, "num_speculative_tokens_per_batch_size": [[1, 256, 2]]}
    capped = run_llm({"model": tiny_llama,
                      "engine": {**base, "speculative_config": schedule,
                                 "disable_log_stats": False},
                      "requests": requests, "rpc": ["runner_stats"], "metrics": True},
                     tmp_path / "schedule")
    assert _ids(capped) == _ids(plain)
    stats = capped["rpc_after"]["runner_stats"]
    assert stats["spec_policy"] == "schedule" and stats["spec_withheld_tokens"] == 0
    assert 0 < stats["spec_draft_tokens"] <= 2 * stats["spec_drafts"]
    per_pos = capped["metrics"]["vllm:spec_decode_num_accepted_tokens_per_pos"]
    assert per_pos[2:] == [0, 0] and sum(per_pos) == stats["spec_accepted_tokens"] > 0
    assert "num_speculative_tokens_per_batch_size [(1, 256, 2)]" in capped["log"]


def _plain_and_preempted(model: str, base: dict, spec: dict, requests: list, tmp_path
                         ) -> tuple[dict, dict]:
    """``requests`` without speculation, then with ``spec`` on 14 KV blocks (vLLM preempts)."""
    (tmp_path / "plain").mkdir()
    (tmp_path / "tight").mkdir()
    plain = run_llm({"model": model, "engine": base, "requests": requests}, tmp_path / "plain")
    tight = run_llm({"model": model,
                     "engine": {**base, "num_gpu_blocks_override": 14,
                                "speculative_config": spec},
                     "requests": requests, "rpc": ["runner_stats"]}, tmp_path / "tight")
    return plain, tight


@pytest.mark.engine
@pytest.mark.slow  # test_greedy_draft_model_with_preemption_... preempts in CI
def test_greedy_ngram_with_preemption(tiny_llama, tmp_path):
    """Too few KV blocks: vLLM preempts and resumes requests mid-speculation; same tokens."""
    prompts = _repetitive(6, seed=5)
    requests = [{"prompt_token_ids": p[:60], "params": {"temperature": 0.0, "max_tokens": 40,
                                                        "ignore_eos": True}} for p in prompts]
    base = _engine(dtype="float32", max_model_len=128)
    plain, tight = _plain_and_preempted(tiny_llama, base, NGRAM, requests, tmp_path)
    stats = tight["rpc_after"]["runner_stats"]
    assert stats["resumed"] > 0, "no request was preempted"
    assert stats["spec_draft_tokens"] > 0
    assert _ids(tight) == _ids(plain)


@pytest.mark.engine
@pytest.mark.parametrize("method", ["ngram", pytest.param("draft_model", marks=pytest.mark.slow)])
def test_abort_during_verification_frees_blocks(tiny_llama, tmp_path, method):
    """A request aborted while its drafts are scheduled for verification (ngram; a draft
    model, here the target itself): every KV block is free again, the runner holds no
    request, the other request finishes all its tokens."""
    import subprocess
    import sys

    from conftest import TESTS

    out = tmp_path / "abort.json"
    spec = ([] if method == "ngram" else [json.dumps(
        {"method": "draft_model", "model": tiny_llama, "num_speculative_tokens": 3})])
    proc = subprocess.run([sys.executable, str(TESTS / "spec_abort_harness.py"), tiny_llama,
                           str(out), *spec], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
    result = json.loads(out.read_text())
    assert result["aborted_with_drafts"] > 0, "the victim had no drafts when aborted"
    assert result["free_after"] == result["free_before"]
    assert result["live_requests"] == 0
    assert len(result["outputs"]["other"]) == 60
    assert len(result["outputs"].get("victim", [])) < 60
    if method == "draft_model":
        assert result["draft_tracked_requests"] == 0


def _target_dists(model_path: str, contexts: list[list[int]], allowed: list[int], temperature):
    """The target model's next-token distributions over ``allowed`` (vLLM's allowed-token mask,
    then temperature), from a plain mlx-lm forward of each whole context (no paged cache, no
    speculation): the reference. Loaded by our loader, which reads transformers 5's
    ``rope_parameters`` that mlx-lm's own loading ignores."""
    import mlx.core as mx

    from vllm_unified.models.loader import load_model

    model = load_model(model_path, dtype=mx.float32, keep_quantized=False).model
    out = []
    for ctx in contexts:
        logits = np.array(model(mx.array([ctx]))[0, -1].astype(mx.float32), dtype=np.float64)
        z = logits[allowed] / temperature
        e = np.exp(z - z.max())
        out.append(e / e.sum())
    return out


def _chi2_sf(x: float, df: int) -> float:
    """Chi-square survival function (regularized upper incomplete gamma; no scipy here)."""
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(x / 2, dtype=torch.float64)))


def _chi2_ppf(q: float, df: int) -> float:
    """The ``q`` quantile of chi-square(df), by bisection on :func:`_chi2_sf`."""
    lo, hi = 0.0, 10.0 * df + 100.0
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if _chi2_sf(mid, df) > 1 - q else (lo, mid)
    return (lo + hi) / 2


def _ncx2_sf(x: float, df: int, lam: float) -> float:
    """Noncentral chi-square survival function: the Poisson(lam / 2) mixture of central ones."""
    j = np.arange(0, int(lam / 2 + 20 * np.sqrt(lam / 2 + 1) + 50))
    log_w = -lam / 2 + j * np.log(lam / 2 + 1e-300) - np.array([math.lgamma(k + 1) for k in j])
    return float(sum(np.exp(w) * _chi2_sf(x, df + 2 * int(k)) for w, k in zip(log_w, j,
                                                                            strict=True)))


def _chi2_parts(counts: np.ndarray, probs: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Observed and expected counts with the bins whose expected count is below 5 merged."""
    expected = n * probs
    small = expected < 5
    if small.any():
        counts = np.append(counts[~small], counts[small].sum())
        expected = np.append(expected[~small], expected[small].sum())
        if expected[-1] == 0:
            counts, expected = counts[:-1], expected[:-1]
    return counts, expected


ALLOWED = [1001, 2002, 3003, 4004, 5005, 6006]


def _second_token_test(model: str, prompt: list[int], temperature: float, ids: list[list[int]],
                       unverified: list[np.ndarray | None]) -> None:
    """The statistics of the random-sampling tests: ``ids`` are ``n`` seeded 2-token outputs
    over :data:`ALLOWED` after ``prompt``; the first token t1 came from the prefill (no
    drafts), the second was verified by the rejection sampler. t1's counts are compared with
    the target's distribution, and for every value of t1 the counts of t2 with the target's
    own conditional distribution (plain mlx-lm forward of prompt + t1): a pooled chi-square
    test (bins with expected count < 5 merged), rejected below p = 1e-3. Its power at
    alpha = 1e-3, from the noncentral chi-square with the group sizes the design expects, is
    computed and asserted >= 0.99 against: drafts accepted unverified (``unverified[v]``: the
    one-hot distribution of the draft after t1 = ``ALLOWED[v]``, None where that draft is not
    in ALLOWED: no contribution); verification on the previous row (t2 ~ t1's distribution);
    verification ignoring the temperature (T = 1)."""
    n = len(ids)
    assert all(len(t) == 2 and set(t) <= set(ALLOWED) for t in ids)
    first = _target_dists(model, [prompt], ALLOWED, temperature)[0]
    cond = _target_dists(model, [prompt + [v] for v in ALLOWED], ALLOWED, temperature)
    cond_t1 = _target_dists(model, [prompt + [v] for v in ALLOWED], ALLOWED, 1.0)
    t1 = np.array([ALLOWED.index(t[0]) for t in ids])
    t2 = np.array([ALLOWED.index(t[1]) for t in ids])

    obs, exp = _chi2_parts(np.bincount(t1, minlength=6), first, n)
    assert _chi2_sf(((obs - exp) ** 2 / exp).sum(), len(obs) - 1) > 1e-3

    alpha, chi, df = 1e-3, 0.0, 0
    alternatives = {"accepted unverified": unverified, "previous row": [first] * 6,
                    "temperature ignored": cond_t1}
    lam = dict.fromkeys(alternatives, 0.0)
    for v in range(6):
        n_v = int((t1 == v).sum())
        expected_n = n * first[v]  # for the power: group sizes as the design expects them
        if n_v == 0:
            continue
        o, e = _chi2_parts(np.bincount(t2[t1 == v], minlength=6), cond[v], n_v)
        chi += ((o - e) ** 2 / e).sum()
        df += len(o) - 1
        for name, alt in alternatives.items():
            if alt[v] is None:
                continue
            _, e0 = _chi2_parts(np.zeros(6), cond[v], round(expected_n))
            _, e1 = _chi2_parts(np.zeros(6), alt[v], round(expected_n))
            if len(e0) == len(e1):
                lam[name] += ((e1 - e0) ** 2 / np.maximum(e0, 1e-9)).sum()
            else:  # different merging: use the unmerged bins
                lam[name] += expected_n * ((alt[v] - cond[v]) ** 2 / cond[v]).sum()
    p_value = _chi2_sf(chi, df)
    critical = _chi2_ppf(1 - alpha, df)
    power = {name: min(1.0, _ncx2_sf(critical, df, lam[name])) for name in alternatives}
    print(f"chi2 {chi:.1f} df {df} p {p_value:.3g}; power at alpha {alpha}: {power}")
    assert all(p >= 0.99 for p in power.values()), power
    assert p_value > alpha, (chi, df)


def _seeded_requests(prompt: list[int], temperature: float, n: int) -> list[dict]:
    return [{"prompt_token_ids": prompt,
             "params": {"temperature": temperature, "seed": i, "max_tokens": 2,
                        "ignore_eos": True, "allowed_token_ids": ALLOWED}} for i in range(n)]


@pytest.mark.engine
def test_random_sampling_keeps_the_target_distribution(tmp_path_factory, tmp_path,
                                                       monkeypatch):
    """Exactness of random sampling under ngram speculation (vLLM's rejection sampler).

    Tiny random Qwen2 (untied head: its next-token distributions are spread, unlike the tied
    tiny Llama's). 1200 seeded requests (temperature 2, six allowed tokens S, max 2 tokens) on
    a prompt that cycles through S: the second token is always verified, because the n-gram
    proposer drafts what followed t1 in the prompt (the draft budget is off, so no step goes
    without drafts). :func:`_second_token_test` checks both tokens against the target model;
    its power against accepting the drafts unverified, verifying on the previous row and
    ignoring the temperature is computed and asserted >= 0.99 at alpha 1e-3. Also: a seeded
    request gives the same tokens alone as in the batch."""
    from tiny_models import make_tiny_checkpoint

    from vllm_unified import envs

    monkeypatch.setenv(envs.SPEC_BUDGET_ENV, "0")
    model = str(make_tiny_checkpoint(tmp_path_factory.mktemp("tiny-qwen2"), "qwen2"))
    prompt = ALLOWED * 4
    temperature, n = 2.0, 1200
    spec_cfg = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1,
                "prompt_lookup_max": 2}
    requests = _seeded_requests(prompt, temperature, n)
    engine = {**_engine(dtype="float32", max_model_len=64), "speculative_config": spec_cfg,
              "max_num_seqs": 256}
    result = run_llm({"model": model, "engine": engine, "rpc": ["runner_stats"],
                      "requests": requests}, tmp_path)
    ids = _ids(result)
    stats_ = result["rpc_after"]["runner_stats"]
    assert stats_["spec_drafts"] >= n  # every second token was verified
    assert 0 < stats_["spec_accepted_tokens"] < stats_["spec_draft_tokens"]
    _second_token_test(model, prompt, temperature, ids,
                       [np.eye(6)[(v + 1) % 6] for v in range(6)])

    (tmp_path / "alone").mkdir()
    alone = run_llm({"model": model, "engine": engine, "requests": [requests[7]]},
                    tmp_path / "alone")
    assert _ids(alone)[0] == ids[7]


def _draft_favouring(model: str, out: Path, tokens: list[int], scale: float) -> str:
    """A copy of checkpoint ``model`` whose LM head rows of ``tokens`` are ``scale`` times
    larger, so its argmax is mostly one of them (which one depends on the context)."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(model, out)
    weights = load_file(str(out / "model.safetensors"))
    weights["lm_head.weight"][tokens] *= scale
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return str(out)


def _draft_argmax(model: str, contexts: list[list[int]]) -> list[int]:
    """The greedy next token of ``model`` (full vocabulary, as the draft proposes it) after
    each context, from a plain mlx-lm forward."""
    import mlx.core as mx

    from vllm_unified.models.loader import load_model

    m = load_model(model, dtype=mx.float32, keep_quantized=False).model
    return [int(mx.argmax(m(mx.array([c]))[0, -1]).item()) for c in contexts]


@pytest.mark.engine
@pytest.mark.slow  # the ngram case of the same check runs in CI
def test_random_sampling_with_a_draft_model_keeps_the_target_distribution(
        tmp_path_factory, tmp_path, monkeypatch):
    """Exactness of random sampling under ``draft_model`` speculation: the target is the tiny
    random Qwen2 of the ngram test, the draft another tiny Qwen2 (other weights) whose LM head
    favours the six allowed tokens S (x50), so its greedy draft after prompt + t1 is, for most
    values of t1, a token of S that the rejection sampler accepts with the target's
    probability of it and otherwise replaces (both paths taken: some drafts accepted, some
    rejected). 1200 seeded requests (temperature 2, max 2 tokens, the draft budget off so
    every second token is verified): :func:`_second_token_test`, power >= 0.99 at alpha 1e-3
    against accepting the drafts unverified (for the values of t1 whose draft is in S),
    verifying on the previous row and ignoring the temperature, computed and asserted.
    Also: a seeded request gives the same tokens alone as in the batch."""
    from tiny_models import make_tiny_checkpoint

    from vllm_unified import envs

    monkeypatch.setenv(envs.SPEC_BUDGET_ENV, "0")
    model = str(make_tiny_checkpoint(tmp_path_factory.mktemp("tiny-qwen2"), "qwen2"))
    other = make_tiny_checkpoint(tmp_path_factory.mktemp("tiny-qwen2-s1"), "qwen2", seed=1)
    draft = _draft_favouring(str(other), tmp_path / "draft", ALLOWED, 50.0)
    prompt = ALLOWED * 4
    temperature, n = 2.0, 1200
    drafted = _draft_argmax(draft, [prompt + [v] for v in ALLOWED])
    unverified = [np.eye(6)[ALLOWED.index(x)] if x in ALLOWED else None for x in drafted]
    assert sum(u is not None for u in unverified) >= 4, drafted
    spec_cfg = {"method": "draft_model", "model": draft, "num_speculative_tokens": 2}
    requests = _seeded_requests(prompt, temperature, n)
    engine = {**_engine(dtype="float32", max_model_len=64), "speculative_config": spec_cfg,
              "max_num_seqs": 256}
    (tmp_path / "batch").mkdir()
    result = run_llm({"model": model, "engine": engine, "rpc": ["runner_stats"],
                      "requests": requests}, tmp_path / "batch")
    ids = _ids(result)
    stats_ = result["rpc_after"]["runner_stats"]
    assert stats_["spec_drafts"] >= n  # every second token was verified
    assert 0 < stats_["spec_accepted_tokens"] < stats_["spec_draft_tokens"]
    assert stats_["spec_policy"] == "off" and stats_["spec_withheld_tokens"] == 0
    _second_token_test(model, prompt, temperature, ids, unverified)

    (tmp_path / "alone").mkdir()
    alone = run_llm({"model": model, "engine": engine, "requests": [requests[7]]},
                    tmp_path / "alone")
    assert _ids(alone)[0] == ids[7]


@pytest.mark.slow  # ~75 s; the CI tier keeps speculation's greedy, preemption and sampling
@pytest.mark.engine  # checks and structured output without speculation
def test_default_model_structured_output_and_stop_strings(default_model, tmp_path):
    """The default model (SmolLM2 GGUF): greedy code-editing style prompt, a regex-constrained
    request (grammar bitmask over the draft rows), a stop string and penalties: the same
    outputs with ngram speculation as without, with drafts accepted; with ``draft_model``
    (the model as its own draft) the same outputs with every draft accepted."""
    text = "def add(a, b):\n    return a + b\n\n" * 3
    requests = [
        {"prompt": text + "Repeat the function above:\n", "params": {"temperature": 0.0,
                                                                     "max_tokens": 48}},
        {"prompt": "The year is", "params": {"temperature": 0.0, "max_tokens": 30,
                                              "structured_outputs": {"regex": "( 19[0-9]{2}){3}"}}},
        {"prompt": text + "Repeat the function above:\n",
         "params": {"temperature": 0.0, "max_tokens": 40, "stop": ["output:"]}},
        {"prompt": text, "params": {"temperature": 0.0, "max_tokens": 30,
                                    "presence_penalty": 0.5, "frequency_penalty": 0.2}},
    ]
    base = _engine(dtype="float32", max_model_len=512)
    (tmp_path / "plain").mkdir()
    (tmp_path / "spec").mkdir()
    plain = run_llm({"model": default_model, "engine": base, "requests": requests},
                    tmp_path / "plain")
    spec = run_llm({"model": default_model, "engine": {**base, "speculative_config": NGRAM},
                    "requests": requests, "rpc": ["runner_stats"]}, tmp_path / "spec")
    assert _ids(spec) == _ids(plain)
    texts = [o["completions"][0]["text"] for o in spec["outputs"]]
    assert texts == [o["completions"][0]["text"] for o in plain["outputs"]]
    import re

    assert re.fullmatch("( 19[0-9]{2}){3}", texts[1]), texts[1]
    assert spec["outputs"][2]["completions"][0]["finish_reason"] == "stop"
    assert spec["rpc_after"]["runner_stats"]["spec_accepted_tokens"] > 0

    # draft_model with the default model (GGUF, kept quantized) as its own draft: the same
    # outputs, every draft accepted where no grammar or penalty changes the target's argmax.
    (tmp_path / "draft").mkdir()
    draft_cfg = {"method": "draft_model", "model": default_model, "num_speculative_tokens": 3}
    draft = run_llm({"model": default_model,
                     "engine": {**base, "speculative_config": draft_cfg},
                     "requests": requests[:1] + requests[2:3], "rpc": ["runner_stats"]},
                    tmp_path / "draft")
    assert _ids(draft) == [_ids(plain)[0], _ids(plain)[2]]
    stats = draft["rpc_after"]["runner_stats"]
    assert stats["spec_accepted_tokens"] == stats["spec_draft_tokens"] > 0, stats


# ------------------------------------------------------------------------------ start-up and server
@pytest.mark.engine
def test_suffix_without_arctic_inference_is_refused_in_one_line(tmp_path):
    """``vllm serve --speculative-config '{"method": "suffix"}'`` without ``arctic-inference``:
    our CLI stops before vLLM starts, with one line naming the flag, the method and the
    package (vLLM's own refusal is a ~40-line traceback); vLLM's config, reached from
    ``LLM(...)``, still refuses with its own message."""
    import importlib.util
    import subprocess
    import sys

    from conftest import default_model_path

    if importlib.util.find_spec("arctic_inference") is not None:
        pytest.skip("arctic-inference is installed: nothing is missing")
    vllm = Path(sys.executable).parent / "vllm"
    for spec_args in (["--speculative-config", '{"method": "suffix", "num_speculative_tokens": 3}'],
                      ['-sc={"method":"suffix"}'], ["--speculative-config.method", "suffix"]):
        proc = subprocess.run([str(vllm), "serve", default_model_path(), *spec_args],
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2, (spec_args, proc.stdout[-2000:], proc.stderr[-2000:])
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1, proc.stderr
        assert "--speculative-config" in lines[0] and "'suffix'" in lines[0]
        assert "arctic-inference" in lines[0], lines[0]
    with pytest.raises(ImportError, match="Arctic Inference is required"):
        compat.SpeculativeConfig(method="suffix", num_speculative_tokens=3)


def _metric_samples(text: str, name: str) -> dict[str, float]:
    """``{labels: value}`` of one Prometheus metric (``name`` with its ``_total``)."""
    import re

    out = {}
    for line in text.splitlines():
        m = re.match(rf"^{re.escape(name)}(?:_total)?(\{{[^}}]*\}})? ([0-9.eE+-]+)$", line)
        if m:
            out[m.group(1) or ""] = float(m.group(2))
    return out


@pytest.mark.engine
@pytest.mark.slow  # the same counters are checked offline by test_greedy_ngram_equals_...
def test_server_reports_spec_decode_metrics(tmp_path):
    """``vllm serve`` the default model with ngram: after a repetitive prompt, /metrics holds
    vLLM's ``vllm:spec_decode_*`` counters (drafts, draft tokens, accepted tokens, accepted
    per position 0..k-1) with drafts and acceptances counted, and the start-up log names the
    method and k."""
    import requests as http
    from conftest import default_server_args, vllm_server

    k = 3
    spec = json.dumps({"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 3})
    args = [*default_server_args("smollm2"), "--speculative-config", spec]
    text = "def add(a, b):\n    return a + b\n\n" * 4
    with vllm_server(tmp_path, args) as (base, _):
        r = http.post(f"{base}/v1/completions", timeout=300, json={
            "model": "smollm2", "prompt": text + "Repeat the function above:\n",
            "temperature": 0.0, "max_tokens": 48})
        assert r.status_code == 200, r.text
        metrics = http.get(f"{base}/metrics", timeout=30).text
    log = (tmp_path / "server.log").read_text()
    assert f"speculative decoding, method ngram, k = {k} draft tokens per step" in log
    drafts = _metric_samples(metrics, "vllm:spec_decode_num_drafts")
    draft_tokens = _metric_samples(metrics, "vllm:spec_decode_num_draft_tokens")
    accepted = _metric_samples(metrics, "vllm:spec_decode_num_accepted_tokens")
    per_pos = _metric_samples(metrics, "vllm:spec_decode_num_accepted_tokens_per_pos")
    assert sum(drafts.values()) > 0, metrics
    assert sum(draft_tokens.values()) >= sum(drafts.values())
    assert 0 < sum(accepted.values()) <= sum(draft_tokens.values())
    positions = {label: v for label, v in per_pos.items() if 'position="' in label}
    assert len(positions) == k, per_pos
    assert sum(positions.values()) == sum(accepted.values())
    first = next(v for label, v in positions.items() if 'position="0"' in label)
    assert first > 0 and all(v <= first for v in positions.values())


# ------------------------------------------------------------------------------ draft model
@pytest.mark.engine
# the target as its own draft (every draft accepted) and a smaller draft (pages of another
# size) run in CI; another random Llama of the target's size in the slow tier
@pytest.mark.parametrize("family", [None, pytest.param("llama", marks=pytest.mark.slow),
                                    "llama_draft"], ids=["target", "llama", "llama_draft"])
def test_greedy_draft_model_equals_no_speculation(tiny_llama, plain_tiny, tmp_path_factory,
                                                  tmp_path, family):
    """``method: draft_model`` with tiny Llama drafts of the target's vocabulary (each with its
    own paged KV cache from the draft layers vLLM's KV manager allocated next to the
    target's): greedy tokens equal those without speculation, batched and chunked. The target
    as its own draft has every draft accepted (this fails if the draft's KV were wrong: its
    drafts would then differ from the target's argmax); another random Llama and a smaller
    one (one layer, 4 KV heads: pages of another size in the same KV cache group) have some
    rejected."""
    from tiny_models import make_tiny_checkpoint

    requests = _draft_requests()
    params = [r["params"] for r in requests]
    k = 3
    plain = plain_tiny["draft"]
    draft = tiny_llama if family is None else str(make_tiny_checkpoint(
        tmp_path_factory.mktemp(f"draft-{family}"), family, seed=1))
    spec_cfg = {"method": "draft_model", "model": draft, "num_speculative_tokens": k}
    spec = run_llm({"model": tiny_llama,
                    "engine": {**GREEDY_BASE, "speculative_config": spec_cfg},
                    "requests": requests, "rpc": ["runner_stats"]}, tmp_path)
    assert _ids(spec) == _ids(plain), family
    stats = spec["rpc_after"]["runner_stats"]
    assert stats["spec_draft_tokens"] > 0, family
    if family is None:
        assert stats["spec_accepted_tokens"] == stats["spec_draft_tokens"], stats
        assert stats["forwards"] < sum(p["max_tokens"] for p in params) / 2
    else:
        assert stats["spec_accepted_tokens"] < stats["spec_draft_tokens"], (family, stats)
    assert stats["live_requests"] == 0 and stats["draft_tracked_requests"] == 0
    assert f"speculative decoding, method draft_model, k = {k}" in spec["log"]


@pytest.mark.engine
def test_greedy_draft_model_with_preemption_max_model_len_int8_kv(tiny_llama, tmp_path):
    """``draft_model`` with too few KV blocks (vLLM preempts and resumes requests: the draft
    recomputes its KV under the new blocks) and one request running up to ``max_model_len``
    (no draft position past it), both with int8 KV pages (the draft's pages take the target's
    ``--kv-cache-dtype``): the same tokens as without speculation."""
    prompts = _repetitive(6, seed=5)
    requests = [{"prompt_token_ids": p[:60], "params": {"temperature": 0.0, "max_tokens": 40,
                                                        "ignore_eos": True}} for p in prompts]
    requests[0]["params"]["max_tokens"] = 68  # 60 + 68 = max_model_len
    base = {**_engine(dtype="float32", max_model_len=128),
            "kv_cache_dtype": "int8_per_token_head"}
    spec_cfg = {"method": "draft_model", "model": tiny_llama, "num_speculative_tokens": 3}
    plain, tight = _plain_and_preempted(tiny_llama, base, spec_cfg, requests, tmp_path)
    stats = tight["rpc_after"]["runner_stats"]
    assert stats["resumed"] > 0, "no request was preempted"
    assert stats["spec_accepted_tokens"] == stats["spec_draft_tokens"] > 0, stats
    assert _ids(tight) == _ids(plain)
    assert len(_ids(tight)[0]) == 68
    assert tight["log"].count("KV format int8_per_token_head") == 2  # target and draft


def test_draft_model_options_the_runner_lacks_are_refused():
    """``draft_model`` with probabilistic drafting, a heterogeneous vocabulary or parallel
    drafting: refused at start-up naming the field."""
    from vllm_unified.platform import _draft_model_policy

    for field, value in (("draft_sample_method", "probabilistic"),
                         ("use_heterogeneous_vocab", True), ("parallel_drafting", True),
                         ("kv_cache_dtype", "int8_per_token_head")):
        spec = types.SimpleNamespace(draft_sample_method="greedy",
                                     use_heterogeneous_vocab=False, parallel_drafting=False,
                                     kv_cache_dtype=None,
                                     verify_equal_vocab_size_if_draft_model=lambda: None)
        setattr(spec, field, value)
        with pytest.raises(ValueError, match=f"--speculative-config.*{field}"):
            _draft_model_policy(spec, "auto")
        setattr(spec, field, None if field == "kv_cache_dtype" else getattr(
            types.SimpleNamespace(draft_sample_method="greedy", use_heterogeneous_vocab=False,
                                  parallel_drafting=False), field))
        _draft_model_policy(spec, "auto")  # the defaults pass
    spec.kv_cache_dtype = "int8_per_token_head"  # the target's own format passes
    _draft_model_policy(spec, "int8_per_token_head")


def test_split_kv_cache_config_gives_each_model_its_layers():
    """vLLM's config over target + draft layers (one group, one stacked tensor, pages of two
    sizes) splits into the target's and the draft's (prefix taken off), same num_blocks,
    layer layout kept, each tensor from offset 0 of its own allocation."""
    from vllm_unified.worker.draft_model import split_kv_cache_config

    def attn(heads):
        return compat.FullAttentionSpec(block_size=16, num_kv_heads=heads, head_size=32,
                                        dtype=torch.float32)

    from vllm.v1.kv_cache_interface import KVCacheGroupSpec, UniformTypeKVCacheSpecs

    names = ["draft_model.model.layers.0.self_attn.attn", "model.layers.0.self_attn.attn",
             "model.layers.1.self_attn.attn"]
    specs = {names[0]: attn(4), names[1]: attn(2), names[2]: attn(2)}
    group = KVCacheGroupSpec(names, UniformTypeKVCacheSpecs(block_size=16,
                                                            kv_cache_specs=specs))
    tensor = compat.KVCacheTensor(size=64 + 3 * 1000, layers=names, layer_stride=1000,
                                  block_stride=10, offset=64)
    config = compat.KVCacheConfig(num_blocks=100, kv_cache_tensors=[tensor],
                                  kv_cache_groups=[group])
    target, draft = split_kv_cache_config(config, {names[0]})
    assert target.num_blocks == draft.num_blocks == 100
    assert [g.layer_names for g in target.kv_cache_groups] == [names[1:]]
    assert target.kv_cache_groups[0].kv_cache_spec == attn(2)
    assert draft.kv_cache_groups[0].layer_names == ["model.layers.0.self_attn.attn"]
    assert draft.kv_cache_groups[0].kv_cache_spec == attn(4)
    (t,), (d,) = target.kv_cache_tensors, draft.kv_cache_tensors
    assert (t.size, t.layers, t.layer_stride, t.block_stride, t.offset) == (
        2000, names[1:], 1000, 10, 0)
    assert (d.size, d.layers, d.offset) == (1000, ["model.layers.0.self_attn.attn"], 0)
    alone = compat.KVCacheConfig(100, [tensor], [KVCacheGroupSpec(names[:1], attn(4)),
                                                 KVCacheGroupSpec(names[1:], attn(2))])
    with pytest.raises(ValueError, match="block table"):
        split_kv_cache_config(alone, {names[0]})
    mixed = compat.KVCacheTensor(size=3000, layers=[names[1], names[0], names[2]],
                                 layer_stride=1000, block_stride=10)
    with pytest.raises(ValueError, match="stacked apart"):
        split_kv_cache_config(compat.KVCacheConfig(100, [mixed], [group]), {names[0]})


def test_methods_the_runner_lacks_are_refused_naming_the_flag():
    from vllm_unified.platform import _speculative_policy

    config = types.SimpleNamespace(speculative_config=types.SimpleNamespace(method="eagle3"))
    with pytest.raises(ValueError, match=r"--speculative-config method 'eagle3'.*'draft_model'"):
        _speculative_policy(config, hybrid=False)
