"""A stand-in for ``torchvision`` where it is not installed, so that vLLM can import its modules
of multimodal architectures and serve their language model.

vLLM 0.32's modules for Gemma 3 / 3n / 4, Mistral 3, Pixtral, Llava, Qwen2-VL, Qwen3-VL,
Qwen3.5, LFM2-VL, Muse Glimmer ... import transformers' image processors at module level, and
transformers 5 writes those on ``torchvision.transforms.v2``: without torchvision vLLM cannot
even inspect the architecture (``Model architectures [...] failed to be inspected``), although
a text prompt never reaches an image processor. On Linux CPU no torchvision that loads can be
installed from PyPI: its Linux wheel is the CUDA build (``torchvision/_C.so`` needs
``libc10_cuda.so``, ``libtorch_cuda.so`` and ``libcudart.so.13``, which torch's CPU build does
not have), so ``import torchvision`` fails ("operator torchvision::nms does not exist") and
the set-up removes it; the CPU build is only on PyTorch's own index.

:func:`install` puts a finder last on ``sys.meta_path`` that answers ``torchvision`` and its
submodules with placeholder modules: every attribute is a placeholder, and calling one raises
:class:`TorchvisionMissing` naming the fix. Installed only while no real torchvision can be
found; multimodal checkpoints are then served text-only (the platform sets vLLM's
``language_model_only``), so nothing calls into it.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
from typing import Any

__all__ = ["FIX", "TorchvisionMissing", "install", "installed"]

#: what a Linux CPU user installs to get a torchvision that loads against torch's CPU build
FIX = ("pip install 'torchvision==0.28.0+cpu' --index-url https://download.pytorch.org/whl/cpu "
       "(the build for torch 2.13.0+cpu; PyPI's Linux wheel is the CUDA build)")
_ROOT = "torchvision"
#: the version the placeholder package reports (no release has it)
VERSION = "0.0.0+vllm-unified-stand-in"


class TorchvisionMissing(RuntimeError):
    """Raised when anything of the stand-in is called: torchvision is not installed."""


class _Placeholder:
    """Any attribute is itself; calling it raises :class:`TorchvisionMissing`."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, name: str) -> _Placeholder:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Placeholder(f"{self._name}.{name}")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise TorchvisionMissing(f"{self._name}: torchvision is not installed (vllm-unified "
                                 f"serves the language model only); to process images: {FIX}")

    def __repr__(self) -> str:
        return f"<torchvision stand-in {self._name}>"


class _StandInModule(types.ModuleType):
    def __getattr__(self, name: str) -> _Placeholder:
        if name.startswith("__"):  # module protocol (__file__, __all__, ...): absent
            raise AttributeError(name)
        return _Placeholder(f"{self.__name__}.{name}")


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Answers ``torchvision`` and ``torchvision.*`` with :class:`_StandInModule` packages."""

    def find_spec(self, fullname: str, path: Any = None,
                  target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != _ROOT and not fullname.startswith(_ROOT + "."):
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = _StandInModule(spec.name)
        module.__path__ = []
        if spec.name == _ROOT:
            module.__version__ = VERSION  # type: ignore[attr-defined]
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        """Nothing to run: every attribute is a placeholder."""


def installed() -> bool:
    """Whether the stand-in finder is on ``sys.meta_path``."""
    return any(isinstance(f, _Finder) for f in sys.meta_path)


def install() -> bool:
    """Put the stand-in finder last on ``sys.meta_path`` unless a real torchvision can be found
    (or the finder is there already). Idempotent.

    Returns:
        Whether the stand-in answers ``import torchvision`` in this process.
    """
    if installed():
        return True
    if _ROOT in sys.modules or importlib.util.find_spec(_ROOT) is not None:
        return False
    sys.meta_path.append(_Finder())
    return True
