"""Which paged attention runs: the production entry point over one layer's K|V pool.

From the backend profile (:func:`vllm_unified.backend.profile`): the native CPU kernel
(:mod:`vllm_unified.kv.attention.cpu`) on MLX's CPU backend with the native extension, the
paged GPU kernels (:mod:`vllm_unified.kv.gpu.paged`, :mod:`vllm_unified.kv.gpu.paged_quant`) on
CUDA and Metal for the head sizes they take, else the pure-MLX reference
(:mod:`vllm_unified.kv.attention.reference`), which every kernel is tested against.
Layers with chunked local attention (``chunk``) run on the same kernels, except over a
quantized pool on a GPU backend, which takes the reference (:func:`chunk_routing`, logged at
start-up by the runner).

Attention logit soft-capping (``softcap``) and attention sinks (``sinks``) are computed by
every kernel (the native CPU kernel, both paged GPU kernels and their SDPA chunks); a native
extension built before it had them is passed over for the reference while they are set.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import mlx.core as mx

from vllm_unified import bridge
from vllm_unified.backend import BackendProfile, profile
from vllm_unified.kv.attention import cpu as cpu_attention
from vllm_unified.kv.attention import reference
from vllm_unified.kv.attention.metadata import AttentionMetadata
from vllm_unified.kv.gpu import paged as gpu_paged
from vllm_unified.kv.gpu import paged_quant as gpu_paged_quant
from vllm_unified.kv.quant import KVFormat


def paged_attention_kv(
    queries: mx.array,
    kv_pool: mx.array,
    meta: AttentionMetadata,
    scale: float,
    window: int | None = None,
    accelerate: bool = True,
    backend: BackendProfile | None = None,
    fresh: tuple[mx.array, mx.array] | None = None,
    kv_format: KVFormat | None = None,
    rht_signs: mx.array | None = None,
    after: mx.array | None = None,
    chunk: int | None = None,
    softcap: float | None = None,
    sinks: mx.array | None = None,
) -> mx.array:
    """:func:`vllm_unified.kv.attention.reference.paged_attention_kv` (same arguments, shapes
    and result, ``softcap`` and ``sinks`` included) by the kernel the profile picks; a
    ``chunk`` (chunked local attention) as :func:`chunk_routing` says.

    With ``accelerate`` (the default): on MLX's CPU backend with the native extension every
    row is attended straight from the pool by the native kernel; on a GPU backend by the paged
    GPU kernel of the profile's dialect, where prefill chunks with no context before them go
    to MLX's SDPA over ``fresh`` (its routing rule); with the CPU kernel turned off
    (``VLLM_UNIFIED_CPU_ATTENTION=0``) the reference with the native ``gather_kv`` primitive
    (:func:`vllm_unified.bridge.gather_kv`, the same values as MLX's gather). A quantized
    ``kv_format`` is read by the native CPU kernel or the quantized paged GPU kernel
    (``rht_signs``: vLLM's RHT signs for int4). ``accelerate=False``: the reference.
    ``backend``: the profile whose kernels to use (the runner's); default
    :func:`vllm_unified.backend.profile`.

    Raises:
        ValueError: as the reference.
        RuntimeError: a quantized pool, accelerated, with neither the native CPU kernel nor
            the paged GPU kernel for this head size.
    """
    if backend is None and accelerate:
        backend = profile()
    quantized = kv_format is not None and kv_format.quantized
    if not accelerate or (chunk is not None and quantized and not _cpu_rows_kernel(backend)):
        return reference.paged_attention_kv(queries, kv_pool, meta, scale, window, fresh,
                                            kv_format, after, chunk=chunk, softcap=softcap,
                                            sinks=sinks)
    reference.check_logit_options(queries.shape[1], softcap, sinks)
    if chunk is not None and _cpu_rows_kernel(backend):
        return _chunked_rows(queries, kv_pool, meta, scale, window, kv_format, rht_signs,
                             fresh, chunk, softcap, sinks)
    if quantized:
        return _quantized_attention(queries, kv_pool, meta, scale, window, backend, kv_format,
                                    rht_signs, fresh, after, softcap, sinks)
    reference.check_kv_pool(queries, kv_pool, meta, window, chunk=chunk)
    if meta.num_tokens and _cpu_rows_kernel(backend) and cpu_attention.takes(softcap, sinks):
        return cpu_attention.paged_attention_rows(queries, kv_pool, meta, scale, window,
                                                  softcap=softcap, sinks=sinks)
    gpu_kernel = _gpu_kernel(queries.shape[-1], backend)
    if gpu_kernel is not None and meta.num_tokens:
        return gpu_kernel(queries, kv_pool, meta, scale, window, fresh, after=after,
                          chunk=chunk, **gpu_paged.options(softcap, sinks))
    # The native CPU primitive copies both halves of each row in one pass, where MLX's generic
    # gather reads the two strided halves separately. Same values either way
    # (tests/test_paged_attention.py compares them).
    return reference.paged_attention_kv(queries, kv_pool, meta, scale, window, after=after,
                                        gather_rows=bridge.gather_kv, chunk=chunk,
                                        softcap=softcap, sinks=sinks)


def _quantized_attention(
    queries: mx.array, kv_pool: mx.array, meta: AttentionMetadata, scale: float,
    window: int | None, backend: BackendProfile, fmt: KVFormat, rht_signs: mx.array | None,
    fresh: tuple[mx.array, mx.array] | None = None, after: mx.array | None = None,
    softcap: float | None = None, sinks: mx.array | None = None,
) -> mx.array:
    """:func:`paged_attention_kv` over a quantized pool, accelerated (see there)."""
    reference.check_kv_pool(queries, kv_pool, meta, window, fmt)
    head_dim = queries.shape[-1]
    raw = reference.fresh_rows(queries, meta, fmt, fresh)
    gpu = _gpu_kernel(head_dim, backend) is not None
    if _cpu_rows_kernel(backend) and not cpu_attention.takes(softcap, sinks):
        # a native build without the options: the reference's dequantize + SDPA
        return reference.paged_attention_kv(queries, kv_pool, meta, scale, window, fresh, fmt,
                                            after, softcap=softcap, sinks=sinks)
    if not (_cpu_rows_kernel(backend) or gpu):
        raise RuntimeError(f"--kv-cache-dtype {fmt.name}: the quantized pages are read by the "
                           "native CPU attention kernel (MLX's CPU backend with the native "
                           "extension, VLLM_UNIFIED_CPU_ATTENTION on) or the paged GPU kernel "
                           "(head sizes that are multiples of 32 up to 256), neither of which "
                           "this backend profile runs")
    if not meta.num_tokens:
        return mx.zeros(queries.shape, dtype=queries.dtype)
    if gpu and not _cpu_rows_kernel(backend):
        return gpu_paged_quant.paged_gpu_attention_quant(
            backend.gpu_attention, queries, kv_pool, meta, scale, window, fmt, rht_signs,
            fresh=fresh, after=after, **gpu_paged.options(softcap, sinks))
    return cpu_attention.paged_attention_rows(queries, kv_pool, meta, scale, window,
                                              fmt.native_mode, rht_signs, raw, softcap=softcap,
                                              sinks=sinks)


def _chunked_rows(
    queries: mx.array, kv_pool: mx.array, meta: AttentionMetadata, scale: float,
    window: int | None, fmt: KVFormat | None, rht_signs: mx.array | None,
    fresh: tuple[mx.array, mx.array] | None, chunk: int, softcap: float | None = None,
    sinks: mx.array | None = None,
) -> mx.array:
    """Chunked local attention by the native CPU kernel, dense or quantized pool (the
    reference where the extension lacks ``softcap`` or ``sinks``)."""
    quantized = fmt is not None and fmt.quantized
    if not cpu_attention.takes(softcap, sinks):
        return reference.paged_attention_kv(queries, kv_pool, meta, scale, window, fresh, fmt,
                                            chunk=chunk, softcap=softcap, sinks=sinks)
    reference.check_kv_pool(queries, kv_pool, meta, window, fmt if quantized else None, chunk)
    if not meta.num_tokens:
        return mx.zeros(queries.shape, dtype=queries.dtype)
    if not quantized:
        return cpu_attention.paged_attention_rows(queries, kv_pool, meta, scale, window,
                                                  chunk=chunk, softcap=softcap, sinks=sinks)
    return cpu_attention.paged_attention_rows(
        queries, kv_pool, meta, scale, window, fmt.native_mode, rht_signs,
        reference.fresh_rows(queries, meta, fmt, fresh), chunk=chunk, softcap=softcap,
        sinks=sinks)


def chunk_routing(backend: BackendProfile | None = None) -> str:
    """Which attention runs chunked local attention layers on ``backend`` (default: the
    process's profile), and why, for the start-up log."""
    backend = backend or profile()
    what = "chunked local attention (attention_chunk_size) runs on the"
    if _cpu_rows_kernel(backend):
        return f"{what} native CPU kernel"
    if backend.gpu_attention is not None:
        return (f"{what} paged GPU kernel ({backend.gpu_attention}); over a quantized KV "
                "cache on the pure-MLX reference attention (the quantized GPU kernel does "
                "not take the chunk option)")
    return f"{what} pure-MLX reference attention"


def gpu_attention_routed(head_dim: int, backend: BackendProfile) -> bool:
    """Whether the rows of a layer of this head size go to the paged GPU kernel (see
    :func:`_gpu_kernel`)."""
    return _gpu_kernel(head_dim, backend) is not None


def _gpu_kernel(head_dim: int, backend: BackendProfile) -> Callable[..., mx.array] | None:
    """The paged GPU attention of ``backend`` in the profile's dialect (``gpu_attention``)
    where it supports the head size, else None (the reference gather + SDPA). Called as
    ``kernel(queries, kv_pool, meta, scale, window, fresh, after=, softcap=, sinks=)``."""
    if backend.gpu_attention is None or not gpu_paged.supported(head_dim):
        return None
    return functools.partial(gpu_paged.paged_gpu_attention, backend.gpu_attention)


def fused_decode_kernel(head_dim: int, backend: BackendProfile | None
                        ) -> Callable[..., mx.array] | None:
    """The paged GPU attention that takes raw query projections in pure-decode steps
    (``kernel(queries, kv_pool, meta, scale, window, prologue=..., softcap=..., sinks=...)``:
    it computes both options), or None where rows are not attended by it (the native CPU
    kernel, the reference, an unsupported head size).
    ``backend``: default :func:`vllm_unified.backend.profile`."""
    if backend is None:
        backend = profile()
    if _cpu_rows_kernel(backend):
        return None
    return _gpu_kernel(head_dim, backend)


def _cpu_rows_kernel(backend: BackendProfile) -> bool:
    """Attend every row of a step with the native CPU kernel (kv/attention/cpu.py): the
    profile's ``cpu_attention`` (:func:`~vllm_unified.kv.attention.cpu.takes` says whether
    it computes soft-capping and sinks)."""
    return backend.cpu_attention


#: Why MLA layers are attended by the reference on GPU backends (for the start-up log).
LATENT_ROUTE_REASON = (
    "MLA layers are attended by the native CPU kernel on MLX's CPU backend (key = value = the "
    "latent row) and by the pure-MLX reference (gather + SDPA) elsewhere: the paged GPU "
    "kernels read K and V as two halves of a cell and take head sizes up to 256")


def paged_attention_latent(
    queries: mx.array,
    latent_pool: mx.array,
    meta: AttentionMetadata,
    scale: float,
    latent_dim: int,
    window: int | None = None,
    after: mx.array | None = None,
    backend: BackendProfile | None = None,
) -> mx.array:
    """:func:`vllm_unified.kv.attention.reference.paged_attention_latent` (same arguments,
    shapes and result), the production entry for MLA layers: the native CPU kernel where the
    profile (``backend``, default :func:`vllm_unified.backend.profile`) attends rows with it
    and the extension has its latent mode, the reference elsewhere
    (:data:`LATENT_ROUTE_REASON`). ``after`` orders the reference's reads after a GPU write;
    the CPU kernel reads the pool array the native write returned.

    Raises:
        ValueError: as the reference.
    """
    if not meta.num_tokens:
        return mx.zeros((*queries.shape[:-1], latent_dim), dtype=queries.dtype)
    backend = backend or profile()
    if _cpu_rows_kernel(backend) and cpu_attention.takes_latent():
        reference.check_latent_pool(queries, latent_pool, meta, latent_dim, window)
        out = cpu_attention.paged_attention_rows(queries, latent_pool, meta, scale, window,
                                                 latent=True)
        return out[..., :latent_dim]
    return reference.paged_attention_latent(queries, latent_pool, meta, scale, latent_dim,
                                            window, after)
