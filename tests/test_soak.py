"""The soak benchmark (``benchmarks/serve.py soak``): its short variant as a test, its server
command against scripts/serve.sh, and its response checks on hand-made responses.

The short variant asserts the correctness checks only (no failed request, every greedy text
equal to its solo text, nothing running and KV usage 0 at the end, the engine alive); the
memory and fd drift it measures is printed, not asserted (timings and drift belong to the
benchmark's full run, see docs/dev/benchmarks.md).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
BENCH = REPO / "benchmarks" / "measure"
sys.path[:0] = [str(BENCH), str(BENCH.parent)]

import soak  # noqa: E402
import soak_traffic as traffic  # noqa: E402

from vllm_unified import envs  # noqa: E402

SHORT = ["--requests", "150", "--concurrency", "8"]


def test_server_command_is_what_serve_sh_runs(tmp_path: Path) -> None:
    """scripts/serve.sh (its set-up step stubbed, ``vllm`` replaced by a script that prints
    its arguments) runs the same ``vllm serve`` command as the soak."""
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "serve.sh").write_text((REPO / "scripts" / "serve.sh").read_text())
    (tmp_path / "scripts" / "setup.sh").write_text("#!/bin/sh\nexit 0\n")
    (tmp_path / "scripts" / "setup.sh").chmod(0o755)
    venv_bin = tmp_path / "venv" / "bin"
    venv_bin.mkdir(parents=True)
    (venv_bin / "python").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    (venv_bin / "vllm").write_text(
        f'#!/bin/sh\nexec "{sys.executable}" -c "import json, sys; '
        f'print(json.dumps(sys.argv[1:]))" "$@"\n')
    for script in ("python", "vllm"):
        (venv_bin / script).chmod(0o755)
    env = {**os.environ, "VENV": str(tmp_path / "venv")}
    env.pop("MODEL", None)
    run = subprocess.run(["bash", str(tmp_path / "scripts" / "serve.sh"), "--port", "18555"],
                         env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    served = json.loads(run.stdout.strip().splitlines()[-1])
    ours = soak.server_command(soak.smollm2_gguf(), 18555, [])
    assert ours[0] == str(Path(sys.executable).parent / "vllm")
    assert sorted_flags(served) == sorted_flags(ours[1:])


def sorted_flags(argv: list[str]) -> tuple[list[str], list[tuple[str, str]]]:
    """Positional arguments in order, ``--flag value`` pairs as a sorted list."""
    positional, pairs, i = [], [], 0
    while i < len(argv):
        if argv[i].startswith("--"):
            pairs.append((argv[i], argv[i + 1]))
            i += 2
        else:
            positional.append(argv[i])
            i += 1
    return positional, sorted(pairs)


def test_plan_covers_the_mix() -> None:
    docs = ["first long document", "second long document", "third long document"]
    pool = traffic.greedy_pool(9, docs, seed=0)
    plan = traffic.make_plan(150, pool, docs, seed=0, abort_fraction=0.1)
    assert len({json.dumps(b.payload, sort_keys=True) for b in pool}) == 9
    assert sum(p.abort is not None for p in plan) == 15
    assert {p.abort[0] for p in plan if p.abort} == {"chunks", "delay"}
    seen = {f for p in plan for f in p.body.features()} | {
        "stream" for p in plan if p.stream} | {"unstreamed" for p in plan if not p.stream}
    assert seen >= {"chat", "completions", "greedy", "sampled", "long", "short", "n>1",
                    "logprobs", "stop", "structured:json", "structured:choice",
                    "structured:regex", "stream", "unstreamed"}
    assert all(p.body is pool[p.greedy_ref] for p in plan if p.greedy_ref is not None)
    assert traffic.make_plan(150, pool, docs, 0, 0.1)[37].body.payload == plan[37].body.payload
    with pytest.raises(ValueError, match="--abort-fraction"):
        traffic.make_plan(10, pool, docs, 0, 1.5)


def _body(**kw) -> traffic.Body:
    return traffic.Body("completions", {}, **kw)


def _out(*texts: str, finish: str = "stop", usage: int = 3, logprobs=None) -> traffic.Outcome:
    choices = {i: traffic.Choice(t, finish, None, list(logprobs or [])) for i, t in
               enumerate(texts)}
    return traffic.Outcome(choices=choices, usage={"prompt_tokens": 40,
                                                   "completion_tokens": usage})


def _problems(body: traffic.Body, out: traffic.Outcome, solo=None) -> list[str]:
    return traffic.check(traffic.Planned(0, body, False, 0 if solo else None, None), out,
                         solo)[0]


def test_checks_pass_good_responses_and_name_bad_ones() -> None:
    assert _problems(_body(stop=["."]), _out("No dots here")) == []
    assert "stop string" in _problems(_body(stop=["."]), _out("A dot. here"))[0]
    assert "expected indices 0..1" in _problems(_body(n=2), _out("one"))[0]
    assert "finish_reason" in _problems(_body(), _out("x", finish="abort"))[0]
    assert "no usage" in _problems(_body(), traffic.Outcome(choices={0: traffic.Choice("x")}))[0]
    assert "1300" in _problems(_body(long=True), _out("x"))[0]
    good_json = '{"name": "Ada", "age": 36}'
    assert _problems(_body(structured="json"), _out(good_json)) == []
    assert "schema" in _problems(_body(structured="json"), _out('{"name": "Ada"}'))[0]
    assert "not JSON" in _problems(_body(structured="json"), _out('{"name": '))[0]
    assert _problems(_body(structured="json"), _out('{"name": ', finish="length")) == []
    assert "not one of" in _problems(_body(structured="choice"), _out("perhaps"))[0]
    assert _problems(_body(structured="regex"), _out("AB-123")) == []
    assert "does not match" in _problems(_body(structured="regex"), _out("AB-12"))[0]
    lps = [("a", -0.1, {"a": -0.1, "b": -2.0})] * 3
    assert _problems(_body(logprobs=True, greedy=True), _out("abc", logprobs=lps)) == []
    assert "2 logprob entries for 3" in _problems(_body(logprobs=True),
                                                  _out("ab", logprobs=lps[:2]))[0]
    below_top = [("b", -2.0, {"a": -0.1, "b": -2.0})] * 3
    assert "below the top" in _problems(_body(logprobs=True, greedy=True),
                                        _out("abc", logprobs=below_top))[0]


def test_greedy_checks_against_the_solo_text() -> None:
    body = _body(greedy=True, logprobs=True)
    lps = [("x", -0.1, {"x": -0.1})] * 3
    solo = _out("The capital is Paris", logprobs=lps)
    assert _problems(body, _out("The capital is Paris", logprobs=lps), solo) == []
    mismatch = _problems(body, _out("The capital is Rome", logprobs=lps), solo)
    assert "differs from solo" in mismatch[0] and "char 15" in mismatch[0]
    tol = traffic.LOGPROB_TOL  # 1e-3 in fp32 arithmetic, 5e-3 in the default integer one
    assert tol == (1e-3 if envs.CPU_ACTIVATIONS == "fp32" else 5e-3)
    drifted = [("x", -0.1 - 2 * tol, {"x": -0.1 - 2 * tol})] * 3
    assert "logprobs differ" in _problems(body, _out("The capital is Paris", logprobs=drifted),
                                          solo)[0]
    within = [("x", -0.1 - tol / 2, {"x": -0.1 - tol / 2})] * 3
    assert _problems(body, _out("The capital is Paris", logprobs=within), solo) == []
    planned = traffic.Planned(0, body, True, 0, ("chunks", 3.0))
    assert traffic.check_aborted(planned, _out("The capital"), solo) == []
    assert "not a prefix" in traffic.check_aborted(planned, _out("The town"), solo)[0]


def test_divergence_names_the_solo_token_and_its_gap() -> None:
    tokens = [("The", -0.1, {"The": -0.1, "A": -3.0}), (" capital", -0.2, {" capital": -0.2}),
              (" is", -0.01, {" is": -0.01}),
              (" Paris", -0.69310, {" Paris": -0.69310, " Rome": -0.69312})]
    solo = _out("The capital is Paris", usage=4, logprobs=tokens)
    d = traffic.divergence(solo, "The capital is Rome")
    assert (d["char"], d["token_index"], d["solo_token"]) == (15, 3, " Paris")
    assert d["solo_top"][1][0] == " Rome" and d["gap"] == pytest.approx(2e-5)
    assert d["other_continues"] == " Rome"
    body = traffic.with_logprobs(traffic.Body("chat", {"temperature": 0.0}, greedy=True))
    assert body.payload == {"temperature": 0.0, "logprobs": True, "top_logprobs": 2}


@pytest.mark.engine
@pytest.mark.slow  # a soak run
def test_short_soak(tmp_path: Path) -> None:
    """150 requests at concurrency 8 through the real server: the correctness checks hold."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        x for x in (str(REPO / "src"), os.environ.get("PYTHONPATH")) if x)}
    run = subprocess.run([sys.executable, str(BENCH / "soak.py"), *SHORT, "--results-dir",
                          str(tmp_path)], env=env, capture_output=True, text=True,
                         timeout=1800)
    print(run.stdout[-6000:])  # the summary with the drift (not asserted)
    results = sorted(tmp_path.glob("soak-*.json"))
    assert results, f"no result (rc={run.returncode}):\n{run.stdout[-4000:]}{run.stderr[-4000:]}"
    r = json.loads(results[-1].read_text())
    bad = [(x["idx"], x["features"], x["problems"]) for x in r["requests"] if x["problems"]]
    assert not bad, bad[:10]
    assert r["checks"] == dict.fromkeys(r["checks"], True), r["checks"]
    s = r["summary"]
    assert s["requests"] == 150 and s["failed"] == 0 and s["greedy_mismatches"] == 0
    assert s["greedy_checked"] > 0 and s["aborted"] > 0
    assert r["settle"]["gauges"] == dict.fromkeys(soak.METRIC_NAMES, 0.0)
    assert run.returncode == 0, run.stdout[-4000:]
