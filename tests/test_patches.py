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
                         patches.patch_anthropic_stream_errors,
                         patches.patch_responses_empty_output_message}
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
