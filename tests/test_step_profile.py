"""The runner's step profile: phase accounting, step kinds and the log interval."""

from __future__ import annotations

import time

import pytest

from vllm_unified.worker.step_profile import LOG_PREFIX, STEP_PROFILE_ENV, StepProfile, log_interval


def _step(profile: StepProfile, num_reqs: int, num_tokens: int, sleep_s: float) -> str | None:
    timer = profile.start()
    timer.mark("prepare")
    time.sleep(sleep_s)
    timer.mark("eval")
    timer.mark("output")
    return profile.finish(timer, num_reqs, num_tokens, num_tokens == num_reqs)


def test_phases_and_kinds_are_accounted_separately() -> None:
    profile = StepProfile(interval=0)
    for _ in range(3):
        assert _step(profile, 4, 4, 0.01) is None  # decode: one token per request
    assert _step(profile, 2, 130, 0.0) is None  # mixed: a prefill chunk
    stats = profile.as_dict()
    assert stats["decode"]["steps"] == 3 and stats["decode"]["requests"] == 12
    assert stats["mixed"]["steps"] == 1 and stats["mixed"]["tokens"] == 130
    decode = stats["decode"]["mean_ms"]
    assert decode["eval"] >= 10.0  # slept 10 ms per step inside the eval phase
    assert decode["eval"] > decode["prepare"] + decode["output"]
    assert decode["total"] == pytest.approx(sum(decode[p] for p in ("prepare", "graph", "eval",
                                                                    "output")))


def test_log_line_every_interval_steps_of_a_kind() -> None:
    profile = StepProfile(interval=2)
    assert _step(profile, 1, 1, 0.0) is None
    assert _step(profile, 1, 9, 0.0) is None  # mixed steps do not count toward decode's line
    line = _step(profile, 3, 3, 0.0)
    assert line is not None and line.startswith(f"{LOG_PREFIX} decode: 2 steps, 2.0 req/step")
    assert _step(profile, 1, 1, 0.0) is None  # the window restarted


def test_queued_step_keeps_its_own_timer() -> None:
    """With asynchronous scheduling step N's output is read after step N+1 started: the wait
    in between is charged to neither (``resume``), and N+1's phases stay its own."""
    profile = StepProfile(interval=0)
    first = profile.start()
    first.mark("eval")
    second = profile.start()
    time.sleep(0.02)
    second.mark("prepare")
    first.resume()
    first.mark("output")
    profile.finish(first, 1, 1, True)
    stats = profile.as_dict()["decode"]["mean_ms"]
    assert stats["prepare"] == 0.0 and stats["output"] < 20.0
    assert second.seconds["prepare"] >= 0.02


def test_interval_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(STEP_PROFILE_ENV, "25")
    assert log_interval() == 25
    monkeypatch.setenv(STEP_PROFILE_ENV, "often")
    with pytest.raises(ValueError, match=STEP_PROFILE_ENV):
        log_interval()
    monkeypatch.delenv(STEP_PROFILE_ENV)
    assert log_interval() == 0
