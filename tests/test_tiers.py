"""The tier marks are enforced: a test that starts an engine or a server without the ``engine``
(or ``slow``) mark fails before it starts one (tests/conftest.py)."""

from __future__ import annotations

import sys

import pytest
from conftest import engine_command, require_engine_mark


def test_engine_commands_are_recognised():
    vllm = "/venv/bin/vllm"
    assert engine_command([vllm, "serve", "m", "--port", "1"]) == "`vllm serve`"
    assert engine_command([sys.executable, "tests/llm_harness.py", "a", "b"]) == "llm_harness.py"
    assert engine_command([sys.executable, "benchmarks/soak.py"]) == "soak.py"
    assert engine_command([sys.executable, "-c", "from vllm import LLM; LLM('m')"])
    for other in ([vllm, "--version"], [sys.executable, "tests/kv_quant_oracle.py"],
                  [sys.executable, "-c", "print(1)"], "ls", ["bash", "scripts/serve.sh"]):
        assert engine_command(other) is None, other


def test_unmarked_test_may_not_start_an_engine():
    with pytest.raises(pytest.fail.Exception, match="marked neither 'engine' nor 'slow'"):
        require_engine_mark("a vLLM engine (run_llm)")


@pytest.mark.engine
def test_marked_test_may_start_an_engine():
    require_engine_mark("a vLLM engine (run_llm)")


def test_in_process_engine_clients_are_guarded():
    from vllm.v1.engine.core_client import EngineCoreClient

    for factory in (EngineCoreClient.make_client, EngineCoreClient.make_async_mp_client):
        with pytest.raises(pytest.fail.Exception, match="a vLLM engine \\(in this process\\)"):
            factory()
