"""Paged attention over the KV pool: per-step metadata, the pure-MLX reference, the CPU kernel,
the q/k prologue."""
