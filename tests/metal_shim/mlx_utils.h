// Stand-in of the prelude MLX puts before a custom Metal kernel's source
// (metal::utils() in MLX 0.32.4: mlx/backend/metal/kernels/utils.h and bf16.h), reduced to
// the names kernels use: Metal's stdlib, `using namespace metal`, float16_t and bfloat16_t.
#pragma once

#include <metal_stdlib>

using namespace metal;

typedef half float16_t;
typedef bfloat bfloat16_t;
