"""Expert weights as transformers writes them, laid out as mlx-lm's ``SwitchGLU`` holds them.

mlx-lm's ``sanitize`` of some mixture-of-experts families reads only the layouts of the
checkpoints mlx-lm converts from. gpt-oss in bf16 / fp32 (transformers' ``GptOssExperts``, what
``save_pretrained`` and the unquantized releases hold) stacks each layer's experts as
``gate_up_proj`` ``[E, hidden, 2 x width]`` with gate and up columns interleaved,
``down_proj`` ``[E, width, hidden]`` and their biases, unsuffixed; mlx-lm's gpt-oss ``sanitize``
reads MXFP4 blocks and its own converted names only, so such a checkpoint would not load.
:func:`with_expert_layout` gives a model class a ``sanitize`` that first rewrites those
tensors to ``switch_mlp``-style names (``experts.gate_proj.weight`` ``[E, width, hidden]``...),
then runs mlx-lm's own.
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx

__all__ = ["EXPERT_LAYOUTS", "gpt_oss_experts", "with_expert_layout"]


def gpt_oss_experts(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """transformers' gpt-oss expert tensors (``*.experts.gate_up_proj`` ``[E, H, 2W]``,
    ``*.experts.gate_up_proj_bias`` ``[E, 2W]``, ``*.experts.down_proj`` ``[E, W, H]``,
    ``*.experts.down_proj_bias`` ``[E, H]``) as mlx-lm's ``experts.{gate,up,down}_proj.
    {weight,bias}`` (weights ``[E, out, in]``, gate = even columns, up = odd); other tensors
    (MXFP4 blocks and scales included) unchanged."""
    out: dict[str, mx.array] = {}
    for name, value in weights.items():
        base, _, leaf = name.rpartition(".")
        if not base.endswith("experts") or leaf not in (
                "gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias"):
            out[name] = value
        elif leaf == "gate_up_proj":
            out[f"{base}.gate_proj.weight"] = mx.contiguous(value[..., ::2].swapaxes(-1, -2))
            out[f"{base}.up_proj.weight"] = mx.contiguous(value[..., 1::2].swapaxes(-1, -2))
        elif leaf == "gate_up_proj_bias":
            out[f"{base}.gate_proj.bias"] = mx.contiguous(value[..., ::2])
            out[f"{base}.up_proj.bias"] = mx.contiguous(value[..., 1::2])
        elif leaf == "down_proj":
            out[f"{base}.down_proj.weight"] = mx.contiguous(value.swapaxes(-1, -2))
        else:
            out[f"{base}.down_proj.bias"] = value
    return out


#: model type -> the rewrite of its transformers-layout expert tensors
EXPERT_LAYOUTS: dict[str, Callable[[dict[str, mx.array]], dict[str, mx.array]]] = {
    "gpt_oss": gpt_oss_experts,
}


def with_expert_layout(model_class: type, model_type: str) -> type:
    """``model_class``, or for a type of :data:`EXPERT_LAYOUTS` a subclass whose ``sanitize``
    rewrites the expert tensors first (then mlx-lm's own ``sanitize``)."""
    rewrite = EXPERT_LAYOUTS.get(model_type)
    if rewrite is None:
        return model_class

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        return model_class.sanitize(self, rewrite(weights))

    return type(model_class.__name__, (model_class,), {
        "sanitize": sanitize, "__module__": model_class.__module__,
        "__doc__": f"{model_class.__doc__ or ''} (expert tensors in transformers' layout)"})
