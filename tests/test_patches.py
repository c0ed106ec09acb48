"""The patches of other packages (vllm_unified.patches): listed, documented, idempotent."""

from __future__ import annotations

import subprocess
import sys

from vllm_unified import patches


def test_every_patch_is_listed_with_its_target_version_and_reason() -> None:
    functions = {p.apply for p in patches.PATCHES}
    assert functions == {patches.patch_torch_accelerator_teardown,
                         patches.install_version_fallback, patches.route_mlx_lm_swiglu,
                         patches.route_mlx_lm_attention}
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
