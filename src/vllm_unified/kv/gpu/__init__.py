"""GPU kernels over the KV pool (MLX CUDA and Metal, one source in two dialects): in-place writes
and paged attention."""
