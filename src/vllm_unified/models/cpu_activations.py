"""Gemma's GeGLU, logit soft-capping and the encoders' GELU on the native CPU kernels (MLX's
CPU backend, fp32).

MLX 0.32.4's CPU ``tanh`` runs one element at a time (~20 ns per fp32 element on a 2-core
AVX-512 machine). Gemma 2, 3 and 4 compute ``gelu_approx(gate) * up`` (a ``tanh`` per MLP
element) in every layer and Gemma 2 / 4 soft-cap every logit with ``cap * tanh(x / cap)``; at
a decode batch of 16 and a 4096-wide MLP that is ~2 ms a layer, more than the layer's matmuls.
The native ``gelu_tanh_mul`` and ``softcap`` (``native/src/cpu_math.cpp``) compute the same
functions with glibc's vectorized ``tanhf`` (tests/test_cpu_kernels.py: within MLX's own
distance from a float64 reference).

mlx-lm's files stay untouched: :func:`install_cpu_activations` swaps the ``__class__`` of
this model's instances of the mlx-lm classes listed in :data:`GEGLU_MLPS` and
:data:`SOFTCAP_MODELS` for subclasses that call :func:`geglu` / :func:`logit_softcap`, and
points the module-level names of :data:`MODULE_FUNCTIONS` at them
(:func:`vllm_unified.patches.route_mlx_lm_functions`). Both fall back to MLX's ops for what
the kernels do not take (another dtype, shapes that differ, no native extension or one built
before these kernels, which is logged once).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from vllm_unified import bridge, patches
from vllm_unified.compat import init_logger

logger = init_logger(__name__)

__all__ = ["GEGLU_MLPS", "MODULE_FUNCTIONS", "SOFTCAP_MODELS", "Gelu", "geglu",
           "install_cpu_activations", "logit_softcap"]


def geglu(gate: mx.array, up: mx.array) -> mx.array:
    """``nn.gelu_approx(gate) * up``: the native kernel for same-shaped fp32 arrays on the
    CPU, MLX's ops otherwise."""
    native = _native()
    if (native is None or gate.dtype != mx.float32 or up.dtype != mx.float32
            or gate.shape != up.shape):
        return nn.gelu_approx(gate) * up
    return native.gelu_tanh_mul(gate, up)


class Gelu(nn.Module):
    """GELU, exact (erf: ``nn.gelu``) or tanh-approximated (``nn.gelu_approx``): the native
    kernel for fp32 on the CPU (MLX 0.32.4's CPU ``erf`` and ``tanh`` run one element at a
    time), MLX's ops otherwise."""

    def __init__(self, approximate: bool = False) -> None:
        super().__init__()
        self.approximate = approximate

    def __call__(self, x: mx.array) -> mx.array:
        native = _native()
        if native is None or x.dtype != mx.float32 or not hasattr(native, "gelu"):
            return nn.gelu_approx(x) if self.approximate else nn.gelu(x)
        return native.gelu(x, approximate=self.approximate)


def logit_softcap(cap: float, x: mx.array) -> mx.array:
    """``mx.tanh(x / cap) * cap`` (argument order of mlx-lm's Gemma 4 ``logit_softcap``): the
    native kernel for an fp32 ``x`` and a positive ``cap`` on the CPU, MLX's ops otherwise."""
    native = _native()
    if native is None or x.dtype != mx.float32 or not isinstance(cap, int | float) or cap <= 0:
        return mx.tanh(x / cap) * cap
    return native.softcap(x, float(cap))


@functools.cache
def _native() -> Any:
    """The native extension where it has ``gelu_tanh_mul`` and ``softcap``, else None."""
    native = bridge.native_kernels()
    if native is None:
        return None
    if not hasattr(native, "gelu_tanh_mul") or not hasattr(native, "softcap"):
        logger.warning("the native CPU kernels were built without gelu_tanh_mul and softcap: "
                       "Gemma's GeGLU and logit soft-capping run on MLX's ops (rebuild the "
                       "extension with scripts/setup.sh)")
        return None
    return native


def _geglu_mlp_call(self: nn.Module, x: mx.array) -> mx.array:
    return self.down_proj(geglu(self.gate_proj(x), self.up_proj(x)))


def _gemma2_model_call(self: nn.Module, inputs: mx.array, cache: Any = None) -> mx.array:
    out = self.model.embed_tokens.as_linear(self.model(inputs, cache))
    return logit_softcap(self.final_logit_softcapping, out)


#: mlx-lm MLP classes whose ``__call__`` is ``down_proj(gelu_approx(gate_proj(x)) *
#: up_proj(x))``, by (module, class)
GEGLU_MLPS: dict[tuple[str, str], Callable[..., mx.array]] = {
    ("mlx_lm.models.gemma2", "MLP"): _geglu_mlp_call,
    ("mlx_lm.models.gemma3_text", "MLP"): _geglu_mlp_call,
}
#: mlx-lm model classes whose ``__call__`` soft-caps the tied head's logits inline
SOFTCAP_MODELS: dict[tuple[str, str], Callable[..., mx.array]] = {
    ("mlx_lm.models.gemma2", "Model"): _gemma2_model_call,
}
#: module -> {module-level function name -> replacement}: each original computes the same
#: function with the same arguments as its replacement
MODULE_FUNCTIONS: dict[str, dict[str, Callable[..., mx.array]]] = {
    "mlx_lm.models.gemma4_text": {"geglu": geglu, "logit_softcap": logit_softcap},
    "mlx_lm.models.gemma3n": {"logit_softcap": logit_softcap},
}


@functools.cache
def _swapped_class(cls: type, call: Callable[..., mx.array]) -> type:
    """A subclass of ``cls`` with ``__call__`` = ``call``, same name (the log and the
    architecture names read it)."""
    return type(cls.__name__, (cls,), {"__call__": call, "__module__": __name__,
                                       "__doc__": f"{cls.__module__}.{cls.__name__} on the "
                                                  "native CPU activations."})


def install_cpu_activations(model: nn.Module) -> list[str]:
    """Route ``model``'s GeGLU MLPs and logit soft-capping to the native kernels (see the
    module docstring) when the native extension is available. Idempotent.

    Returns:
        What was routed, for the log; empty without the native extension.
    """
    if _native() is None:
        return []
    counts: dict[str, int] = {}
    for module in model.modules():
        cls = type(module)
        key = (cls.__module__, cls.__name__)
        call = GEGLU_MLPS.get(key) or SOFTCAP_MODELS.get(key)
        if call is None:
            continue
        module.__class__ = _swapped_class(cls, call)
        what = "GeGLU MLP" if key in GEGLU_MLPS else "final logit soft-capping"
        counts[what] = counts.get(what, 0) + 1
    routed = [f"{n} {what}" for what, n in counts.items()]
    routed += [f"{name} of {module}" for module, name in
               patches.route_mlx_lm_functions(model, MODULE_FUNCTIONS)]
    return routed
