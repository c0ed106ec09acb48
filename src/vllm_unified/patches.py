"""Every patch of another package, in one place.

(The other patches are being moved here; see PATCHES.)
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable
from typing import Any


# --------------------------------------------------------------------- mlx-lm attention
def original_mlx_lm_sdpa() -> Callable[..., Any]:
    """mlx-lm's own ``mlx_lm.models.base.scaled_dot_product_attention`` (imports mlx-lm)."""
    import mlx_lm.models.base as mlx_base

    return mlx_base.scaled_dot_product_attention


def route_mlx_lm_attention(module_names: Iterable[str], replacement: Callable[..., Any]
                           ) -> list[str]:
    """Point ``scaled_dot_product_attention`` of each already-imported module in
    ``module_names`` that took mlx-lm's function at import (``from .base import
    scaled_dot_product_attention``: every mlx-lm 0.32.2 model module) at ``replacement``.

    mlx-lm 0.32.2. ``mlx_lm.models.base`` itself is left alone, so
    :func:`original_mlx_lm_sdpa` stays the original and ``replacement`` can call it for caches
    that are not ours. Idempotent. Returns the names of the modules changed.
    """
    original = original_mlx_lm_sdpa()
    patched = []
    for name in module_names:
        module = sys.modules.get(name)
        if name != "mlx_lm.models.base" and \
                getattr(module, "scaled_dot_product_attention", None) is original:
            module.scaled_dot_product_attention = replacement
            patched.append(name)
    return patched
