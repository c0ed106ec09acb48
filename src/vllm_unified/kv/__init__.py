"""The KV cache end to end (the runner holds one :class:`vllm_unified.kv.cache.KVCache`).

- ``allocation``: vLLM's layout (``allocate_kv_cache`` / ``create_kv_cache_views``) in one
  page-aligned buffer, lazy (uninitialised) or zeroed where vLLM needs it, and its import into
  MLX without a copy;
- ``pool``: the attention pages as MLX arrays and their write paths;
- ``attention``: paged attention (per-step metadata, the pure-MLX reference, the CPU kernel,
  the q/k prologue, and the dispatch that picks the kernel);
- ``gpu``: the GPU kernels (MLX CUDA and Metal, one source in two dialects): in-place KV and row
  writes, quantizing writes, paged attention over plain and quantized pages;
- ``state_pages``: hybrid models' recurrent state in vLLM's state (Mamba) pages;
- ``hybrid``: which layers are recurrent, their specs, each request's state slot;
- ``block_translation``: kernel block sizes and vLLM's pages read as kernel blocks;
- ``forward_context``: the step context the runner binds for a forward, which the layer
  caches and the recurrent mixers read;
- ``layer_cache``: the per-layer caches mlx-lm's model code sees;
- ``cache``: the facade;
- ``block_reuse``: the scheduler's free-block order (written blocks before fresh ones) and the
  prefix-cache bound, which keep the lazy pool's resident pages to what the load needs;
- ``page_release``: the pages of blocks beyond that bound given back to the OS.

This ``__init__`` imports nothing: the platform reads ``block_translation`` (no MLX) in vLLM's
API-server process, before the engine is forked.
"""
