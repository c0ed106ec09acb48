"""Paged attention over the KV pool: per-step metadata, the pure-MLX reference (imports no
kernel), the CPU kernel, the q/k prologue, and the dispatch that picks the kernel to run."""
