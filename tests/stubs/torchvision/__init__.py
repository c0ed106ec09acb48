"""A stand-in for torchvision, put on ``PYTHONPATH`` only by tests that start vLLM with a
Qwen3.5 checkpoint where torchvision is not installed (``scripts/setup.sh`` removes PyPI's
build, which does not match torch's CPU build).

vLLM 0.32's ``qwen3_5`` module imports its vision model, whose transformers image processor
imports torchvision at module level, so vLLM cannot even inspect the text-only
``Qwen3_5ForCausalLM`` without it. Text generation never calls torchvision: every name here
resolves to a placeholder that raises when called.
"""

from __future__ import annotations

import sys
import types

__version__ = "0.0.0+test-stub"

_SUBMODULES = ("io", "transforms", "transforms.functional", "transforms.v2",
               "transforms.v2.functional")


class _Placeholder:
    """Any attribute is itself; calling it raises (nothing may really use torchvision)."""

    def __getattr__(self, name: str) -> _Placeholder:
        if name.startswith("__"):
            raise AttributeError(name)
        return self

    def __call__(self, *args: object, **kwargs: object) -> None:
        raise RuntimeError("torchvision is a test stub here (tests/stubs/torchvision)")


_PLACEHOLDER = _Placeholder()


def __getattr__(name: str) -> _Placeholder:
    if name.startswith("__"):  # module protocol (__file__, __path__...): absent
        raise AttributeError(name)
    return _PLACEHOLDER


for _name in _SUBMODULES:
    _module = types.ModuleType(f"{__name__}.{_name}")
    _module.__getattr__ = __getattr__  # type: ignore[attr-defined]
    sys.modules[_module.__name__] = _module
