"""The patches of other packages (vllm_unified.patches): listed, documented, idempotent."""

from __future__ import annotations

import mmap
import os
import subprocess
import sys

import pytest

from vllm_unified import patches


def test_every_patch_is_listed_with_its_target_version_and_reason() -> None:
    functions = {p.apply for p in patches.PATCHES}
    assert functions == {patches.patch_torch_accelerator_teardown,
                         patches.install_version_fallback, patches.route_mlx_lm_swiglu,
                         patches.route_mlx_lm_attention,
                         patches.place_offload_region_outside_dev_shm,
                         patches.route_rejection_sampler_kernels,
                         patches.name_chat_template_flag,
                         patches.stop_engine_core_gracefully,
                         patches.harden_engine_core_signals,
                         patches.patch_anthropic_stream_errors,
                         patches.patch_responses_empty_output_message,
                         patches.bound_prefix_cache_residency,
                         patches.load_structured_output_tokenizer_lazily,
                         patches.stand_in_for_missing_torchvision,
                         patches.serve_text_only_without_processor_files}
    for patch in patches.PATCHES:
        assert any(ch.isdigit() for ch in patch.package), patch  # names the version it targets
        doc = patch.apply.__doc__ or ""
        assert "Idempotent" in doc or "idempotent" in doc, patch.apply.__name__


def test_importing_patches_imports_neither_mlx_nor_torch() -> None:
    code = ("import sys, vllm_unified.patches; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('mlx', 'mlx_lm', 'torch',"
            " 'vllm')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def _structured_output_config(skip_tokenizer_init: bool = False):  # noqa: ANN202
    """The fields StructuredOutputManager.__init__ reads (vLLM 0.32)."""
    from types import SimpleNamespace

    return SimpleNamespace(
        parallel_config=SimpleNamespace(distributed_executor_backend="mp"),
        scheduler_config=SimpleNamespace(max_num_seqs=8),
        model_config=SimpleNamespace(skip_tokenizer_init=skip_tokenizer_init),
        structured_outputs_config=SimpleNamespace(reasoning_parser_plugin="",
                                                  reasoning_parser="",
                                                  enable_in_reasoning=False))


def test_structured_output_tokenizer_loads_at_first_use(monkeypatch) -> None:
    """The engine core's StructuredOutputManager no longer loads its tokenizer at start-up:
    the first read of ``tokenizer`` (its grammar backend, at the first structured request)
    loads it once, with the arguments vLLM passes; with skip_tokenizer_init it stays unset."""
    import vllm.v1.structured_output as so

    patches.load_structured_output_tokenizer_lazily()
    patches.load_structured_output_tokenizer_lazily()  # idempotent
    calls, tokenizer = [], object()

    def loader(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        calls.append((args, kwargs))
        return tokenizer

    monkeypatch.setattr(so, "cached_tokenizer_from_config", loader)
    config = _structured_output_config()
    manager = so.StructuredOutputManager(config)
    assert calls == []
    assert so.cached_tokenizer_from_config is loader  # restored after __init__
    assert manager.tokenizer is tokenizer and manager.tokenizer is tokenizer
    assert calls == [((), {"model_config": config.model_config})]
    manager.clear_backend()
    skipped = so.StructuredOutputManager(_structured_output_config(skip_tokenizer_init=True))
    with pytest.raises(AttributeError):
        skipped.tokenizer  # noqa: B018
    assert len(calls) == 1


def test_torch_teardown_patch_is_idempotent() -> None:
    import torch

    patches.patch_torch_accelerator_teardown()
    first = torch.accelerator.empty_cache
    patches.patch_torch_accelerator_teardown()
    assert torch.accelerator.empty_cache is first
    if not torch.accelerator.is_available():
        assert torch.accelerator.empty_cache() is None


@pytest.fixture
def region_class():
    """vLLM's SharedOffloadRegion, with the path patch removed again afterwards."""
    from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion

    assert "mmap_path" not in SharedOffloadRegion.__dict__  # /dev/shm exists here
    yield SharedOffloadRegion
    if "mmap_path" in SharedOffloadRegion.__dict__:
        del SharedOffloadRegion.mmap_path


def test_offload_region_leaves_dev_shm_where_there_is_none(region_class, tmp_path) -> None:
    """Forced into ``tmp_path`` (as on macOS, where /dev/shm is absent): vLLM's region creates,
    maps and shares its file there, every reader sees that path, and cleanup works."""
    assert patches.place_offload_region_outside_dev_shm() is None  # Linux: nothing to do
    assert "mmap_path" not in region_class.__dict__
    assert patches.place_offload_region_outside_dev_shm(str(tmp_path)) == str(tmp_path)
    assert patches.place_offload_region_outside_dev_shm(str(tmp_path)) == str(tmp_path)
    kw = {"num_chunks": 2, "rank": None, "kv_bytes_per_chunk": mmap.PAGESIZE,
          "cpu_page_size": mmap.PAGESIZE}
    creator = region_class(engine_id="patch-test", **kw)
    joiner = region_class(engine_id="patch-test", **kw)  # opens the same file by name
    try:
        path = str(tmp_path / "vllm_offload_patch-test.mmap")
        assert creator.mmap_path == joiner.mmap_path == path
        assert creator._creator and not joiner._creator
        assert os.path.getsize(path) == 2 * mmap.PAGESIZE
        creator.mmap_obj[:5] = b"bytes"
        assert joiner.mmap_obj[:5] == b"bytes"  # one shared mapping
    finally:
        joiner.cleanup()
        creator.cleanup()
    assert not os.path.exists(path)


def test_chat_without_template_names_the_flag_and_warns_once(default_model, caplog,
                                                              monkeypatch) -> None:
    """Chat on a model without a chat template: vLLM's error names
    ``--chat-template`` (not transformers' "default chat template is no longer allowed"), and
    the first one is logged as a warning (at start-up, where vLLM's renderer warm-up renders
    a chat)."""
    import logging
    import types

    from transformers import AutoTokenizer
    from vllm.renderers import hf
    from vllm.renderers.chat_utils import ChatTemplateResolutionError

    original = hf.safe_apply_chat_template
    original = getattr(original, "__wrapped__", original)  # a platform hook may have run
    monkeypatch.setattr(hf, "safe_apply_chat_template", original)
    log = logging.getLogger("test_chat_template_patch")
    patches.name_chat_template_flag(log)
    wrapped = hf.safe_apply_chat_template
    patches.name_chat_template_flag(log)
    assert hf.safe_apply_chat_template is wrapped  # idempotent
    tokenizer = AutoTokenizer.from_pretrained(default_model)
    conversation = [{"role": "user", "content": "hi"}]
    config = types.SimpleNamespace(
        model=default_model, served_model_name=["base-model"], tokenizer=default_model,
        tokenizer_revision=None, code_revision=None, trust_remote_code=False,
        hf_config=types.SimpleNamespace(model_type="llama"))
    assert "hi" in hf.safe_apply_chat_template(config, tokenizer, conversation, tokenize=False)
    tokenizer.chat_template = None
    with caplog.at_level(logging.WARNING, logger=log.name):
        for _ in range(2):
            with pytest.raises(ChatTemplateResolutionError) as e:
                hf.safe_apply_chat_template(config, tokenizer, conversation, tokenize=False)
            assert "'base-model' has no chat template" in str(e.value)
            assert "--chat-template" in str(e.value)
            assert "no longer allowed" in str(e.value.__cause__)
    warnings = [r.getMessage() for r in caplog.records if "--chat-template" in r.getMessage()]
    assert len(warnings) == 1, warnings


def test_engine_core_shutdown_window_and_expected_engine_dead(monkeypatch) -> None:
    """Server shutdown: under vLLM's default ``--shutdown-timeout 0`` the process manager
    waits up to the window for the engine core (other timeouts are kept), and once the server
    is stopping, only vLLM's output-handler ``EngineDeadError`` record is dropped."""
    import logging
    import threading

    from vllm.v1.engine import utils
    from vllm.v1.engine.exceptions import EngineDeadError

    calls: list[float | None] = []
    monkeypatch.setattr(utils, "shutdown", lambda procs, timeout=None: calls.append(timeout))
    monkeypatch.setattr(patches, "engine_core_stopping", threading.Event())
    vllm_logger = logging.getLogger("vllm.v1.engine.async_llm")
    monkeypatch.setattr(vllm_logger, "filters", list(vllm_logger.filters))
    patches.stop_engine_core_gracefully(10.0, logging.getLogger("test_shutdown_patch"))
    ours = vllm_logger.filters[-1]

    def record(msg: str, exc: BaseException | None) -> logging.LogRecord:
        info = (type(exc), exc, None) if exc is not None else None
        return logging.LogRecord(vllm_logger.name, logging.ERROR, __file__, 1, msg, (), info)

    dead = record("AsyncLLM output_handler failed.", EngineDeadError())
    utils.shutdown([], timeout=None)  # vLLM's clean-up after an engine core died by itself
    assert calls == [None] and not patches.engine_core_stopping.is_set()
    assert ours.filter(dead)  # that death keeps its traceback
    utils.shutdown([], timeout=0)
    assert calls[-1] == 10.0 and patches.engine_core_stopping.is_set()
    utils.shutdown([], timeout=3)
    assert calls[-1] == 3
    assert not ours.filter(dead)
    assert ours.filter(record("AsyncLLM output_handler failed.", RuntimeError("x")))
    assert ours.filter(record("something else", EngineDeadError()))


def test_engine_core_shutdown_reaps_the_engine_before_vllm_checks_it(monkeypatch) -> None:
    """Under ``--shutdown-timeout 0`` the wrapper sends SIGTERM and waits until the engine
    core is reaped before vLLM's own shutdown looks: vLLM kills whatever ``is_alive()`` still
    reports right after the sentinel closes, which an exiting process can be for a moment."""
    import logging
    import multiprocessing
    import signal
    import threading
    import time

    from vllm.v1.engine import utils

    seen: list[list[bool]] = []
    monkeypatch.setattr(utils, "shutdown",
                        lambda procs, timeout=None: seen.append([p.is_alive() for p in procs]))
    monkeypatch.setattr(patches, "engine_core_stopping", threading.Event())
    vllm_logger = logging.getLogger("vllm.v1.engine.async_llm")
    monkeypatch.setattr(vllm_logger, "filters", list(vllm_logger.filters))
    patches.stop_engine_core_gracefully(10.0, logging.getLogger("test_shutdown_patch"))
    # the child forks with SIGTERM's default action, whatever handler an earlier test left in
    # this process (a child inherits it, and SIGTERM may arrive before its target runs)
    child = multiprocessing.get_context("fork").Process(target=time.sleep, args=(60,))
    previous = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        child.start()
    finally:
        signal.signal(signal.SIGTERM, previous)
    utils.shutdown([child], timeout=0)
    assert seen == [[False]]
    assert child.exitcode == -signal.SIGTERM


def test_engine_core_signal_trigger_survives_a_nested_signal(monkeypatch) -> None:
    """Server shutdown: a second signal arriving inside the first handler's
    ``Event.set`` (a process-group SIGTERM, then vLLM's own) must not re-enter it (vLLM's
    version deadlocks on the event's lock); the shutdown callback still runs once. ``stop``
    (called once the engine core's busy loop has ended) leaves SIGTERM ignored."""
    import signal

    from vllm.v1.engine.utils import SignalCallback

    patches.harden_engine_core_signals()
    ran, nested = [], []
    callback = SignalCallback(lambda: ran.append(1))
    real_set = callback._event.set

    def set_with_a_nested_signal() -> None:
        nested.append(1)
        callback.trigger()  # the second signal's handler, inside the first Event.set
        real_set()

    callback._event.set = set_with_a_nested_signal
    callback.trigger()
    callback._thread.join(10)
    assert (nested, ran) == ([1], [1])
    previous = signal.getsignal(signal.SIGTERM)
    try:
        callback.stop()
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGTERM, previous)
