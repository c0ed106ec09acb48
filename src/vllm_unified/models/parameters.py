"""How many parameters a loaded mlx-lm model has, how many a token reads, and how they are held.

A mixture-of-experts model reads only ``top_k`` of each expert layer's ``E`` experts per token:
its active parameters are the ones outside expert layers plus ``top_k / E`` of those inside.
Expert layers are mlx-lm's ``SwitchLinear`` / ``QuantizedSwitchLinear`` (weights
``(E, out, in)``); ``top_k`` is read from the MoE block that holds them (mlx-lm names it
``top_k`` or ``num_experts_per_tok``), else from the config's ``num_experts_per_tok``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import mlx.nn as nn

__all__ = ["ParameterSummary", "parameter_summary"]

_TOP_K_NAMES = ("top_k", "num_experts_per_tok")
#: the config's names for it (Kimi's spelling second)
_CONFIG_TOP_K_NAMES = ("num_experts_per_tok", "num_experts_per_token")


@dataclass
class ParameterSummary:
    """Counts (parameters, not bytes) and resident bytes per storage format."""

    total: int = 0
    active: int = 0
    #: format ("float32", "4-bit affine", "mxfp4", ...) -> (parameters, bytes)
    by_format: dict[str, list[int]] = field(default_factory=dict)

    def describe(self) -> str:
        """One line for the start-up log."""
        held = sum(b for _, b in self.by_format.values())
        formats = ", ".join(f"{name} {_count(n)} in {b / 2**20:.1f} MiB"
                            for name, (n, b) in sorted(self.by_format.items()))
        active = (f", {_count(self.active)} active per token" if self.active != self.total
                  else "")
        return (f"{_count(self.total)} parameters{active}; weights held: "
                f"{held / 2**20:.1f} MiB ({formats})")


def _count(n: int) -> str:
    for unit, size in (("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return str(n)


def _format(module: nn.Module) -> str | None:
    bits = getattr(module, "bits", None)
    if bits is None or not hasattr(module, "scales"):
        return None
    mode = getattr(module, "mode", "affine")
    return mode if mode != "affine" else f"{bits}-bit affine"


def _top_k(path: str, modules: Mapping[str, nn.Module], config: Mapping[str, Any]) -> int:
    """``top_k`` of the MoE block above the expert layer at ``path``."""
    parts = path.split(".")
    for end in range(len(parts) - 1, 0, -1):
        block = modules.get(".".join(parts[:end]))
        for owner in [block, *(getattr(block, "children", dict)() or {}).values()]:
            for name in _TOP_K_NAMES:
                value = getattr(owner, name, None)
                if isinstance(value, int) and value > 0:
                    return value
    text = config.get("text_config") or {}
    k = next((c.get(name) for c in (config, text) for name in _CONFIG_TOP_K_NAMES
              if c.get(name)), None)
    if not k:
        raise ValueError(f"expert layer {path}: no top_k found on its MoE block or in the "
                         f"config ({' or '.join(_CONFIG_TOP_K_NAMES)})")
    return int(k)


def parameter_summary(model: nn.Module, config: Mapping[str, Any]) -> ParameterSummary:
    """Parameters of ``model`` (quantized weights counted as the values they stand for), the
    active ones per token, and the bytes held per format (weights with their scales and
    biases).

    Raises:
        ValueError: an expert layer whose ``top_k`` is nowhere to be found.
    """
    from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchLinear

    modules = dict(model.named_modules())
    out = ParameterSummary()
    for path, module in modules.items():
        # the module's own arrays (as Module.parameters() keeps them: no "_" names)
        own = {k: v for k, v in module.items() if isinstance(v, mx.array) and k[0] != "_"}
        if not own:
            continue
        fmt = _format(module)
        count = sum(a.size * 32 // module.bits if fmt is not None and name == "weight" else
                    0 if fmt is not None and name in ("scales", "biases") else a.size
                    for name, a in own.items())
        name = fmt or str(own.get("weight", next(iter(own.values()))).dtype)
        entry = out.by_format.setdefault(name.removeprefix("mlx.core."), [0, 0])
        entry[0] += count
        entry[1] += sum(a.nbytes for a in own.values())
        out.total += count
        if isinstance(module, SwitchLinear | QuantizedSwitchLinear):
            experts = module.weight.shape[0]
            out.active += count * min(_top_k(path, modules, config), experts) // experts
        else:
            out.active += count
    return out
