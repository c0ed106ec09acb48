"""Every GPU kernel instance the wrappers build, with the text handed to MLX, as SHA-256s.

``mx.fast.cuda_kernel`` / ``mx.fast.metal_kernel`` are replaced by recorders, then the
wrappers' own entry points are called over a grid of dialects, dtypes, head sizes, formats,
prologues and launch shapes (no GPU needed). For each kernel object built it records the
name, the input and output names, the source and the header exactly as MLX would get them;
for each Metal call also the full source MLX 0.32.4 would compile
(:func:`vllm_unified.gpu_dialect.mlx_metal_source` over the call's inputs and template).

    PYTHONPATH=src python tests/kernel_instances.py > hashes.txt

prints one line per kernel object (``dialect name inputs -> outputs sha``), one line per
distinct Metal call text hashed together per kernel, and a total. Two trees whose kernel text
is the same print the same lines. :func:`record` is also what
``tests/test_kernel_files.py`` uses to see every instance fully substituted.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from vllm_unified import gpu_dialect


@dataclass
class Instance:
    """One kernel object as MLX's constructor received it, and the Metal texts of its calls."""

    dialect: str
    name: str
    input_names: tuple[str, ...]
    output_names: tuple[str, ...]
    source: str
    header: str
    metal_calls: set[str] = field(default_factory=set)
    #: CUDA calls: (input dtypes and ndims, output dtypes, template), distinct, in call order
    cuda_calls: list[tuple] = field(default_factory=list)

    def digest(self) -> str:
        blob = json.dumps([self.dialect, self.name, self.input_names, self.output_names,
                           self.source, self.header])
        return hashlib.sha256(blob.encode()).hexdigest()

    def calls_digest(self) -> str:
        return hashlib.sha256("\0".join(sorted(self.metal_calls)).encode()).hexdigest()


@contextlib.contextmanager
def _recording() -> Iterator[list[Instance]]:
    instances: list[Instance] = []

    def maker(dialect: str):
        def make(*, name, input_names, output_names, source, header="", **_):
            inst = Instance(dialect, name, tuple(input_names), tuple(output_names), source,
                            header)
            instances.append(inst)

            def call(*, inputs, output_shapes, output_dtypes, template=(), **_):
                if dialect == "metal":
                    _, text = gpu_dialect.mlx_metal_source(
                        name, input_names, output_names, source, inputs, template,
                        output_dtypes=output_dtypes, header=header)
                    inst.metal_calls.add(text)
                else:
                    key = (tuple((a.dtype, a.ndim) for a in inputs), tuple(output_dtypes),
                           tuple(template))
                    if key not in inst.cuda_calls:
                        inst.cuda_calls.append(key)
                return [mx.zeros(s, d) for s, d in zip(output_shapes, output_dtypes,
                                                          strict=True)]
            return call
        return make

    saved = mx.fast.cuda_kernel, mx.fast.metal_kernel
    _clear_caches()
    mx.fast.cuda_kernel, mx.fast.metal_kernel = maker("cuda"), maker("metal")
    try:
        yield instances
    finally:
        mx.fast.cuda_kernel, mx.fast.metal_kernel = saved
        _clear_caches()


def _clear_caches() -> None:
    from vllm_unified.kv.gpu import paged, paged_quant
    from vllm_unified.models import gpu_gemm

    for fn in (gpu_dialect._kernel, paged._kernel, paged_quant._kernel, gpu_gemm._kernel):
        fn.cache_clear()


def _prologues(dim: int):
    from vllm_unified.kv.attention.qk_prologue import QKPrologue

    inv = np.linspace(1.0, 0.01, dim // 2).astype(np.float32)
    w = np.ones(dim, np.float32)
    yield QKPrologue.build(dim, None)
    yield QKPrologue.build(dim, inv)
    yield QKPrologue.build(dim, inv, traditional=True, norm=(w, w, 1e-6))


def _drive() -> None:
    from vllm_unified.kv.gpu import paged, paged_quant, quant_write, write
    from vllm_unified.kv.quant import SUPPORTED_KV_CACHE_DTYPES, kv_format, rht_signs
    from vllm_unified.models import gpu_gemm

    dtypes = (mx.float32, mx.float16, mx.bfloat16)
    tokens, kv_heads = 3, 2
    slots = mx.array([5, 1, 7], dtype=mx.int32)
    tables = mx.zeros((tokens, 4), dtype=mx.int32)
    decode_lens = mx.array([3, 9, 17], dtype=mx.int32)
    prefill_tiles = mx.array([[0, 3, 0, 11]], dtype=mx.int32)
    for dialect in gpu_dialect.DIALECTS:
        for dtype in dtypes:
            for dim in paged.HEAD_SIZES:
                pool = mx.zeros((16, kv_heads, 2 * dim), dtype)
                keys = mx.zeros((tokens, kv_heads, dim), dtype)
                write.write_kv_gpu(pool, slots, keys, keys, dialect=dialect)
                write.write_kv_gpu(pool, slots, keys[:, :, None], keys[:, :, None],
                                   dialect=dialect)
                for pro in _prologues(dim):
                    write.write_kv_qk_gpu(pool, slots, keys, keys, slots, pro, dialect=dialect)
                for group in (1, 2, 4):
                    q = mx.zeros((tokens, kv_heads * group, 1, dim), dtype)
                    for window in (None, 16):
                        paged.launch(dialect, q, pool, tables, decode_lens, 0.5, window, 16, 1,
                                     True)
                        rows = paged.q_tile(group, dim)
                        paged.launch(dialect, q, pool, tables, prefill_tiles, 0.5, window, 16,
                                     rows, False)
                    for pro in _prologues(dim):
                        paged.launch(dialect, q, pool, tables, decode_lens, 0.5, None, 16, 1,
                                     True, pro)
                    # the attention options: soft-capping, sinks, both (and with a prologue)
                    sinks = mx.zeros((kv_heads * group,), mx.float32)
                    for opts in ({"softcap": 30.0}, {"sinks": sinks},
                                 {"softcap": 30.0, "sinks": sinks}):
                        paged.launch(dialect, q, pool, tables, decode_lens, 0.5, 16, 16, 1,
                                     True, **opts)
                        paged.launch(dialect, q, pool, tables, prefill_tiles, 0.5, None, 16,
                                     paged.q_tile(group, dim), False, **opts)
                    paged.launch(dialect, q, pool, tables, decode_lens, 0.5, None, 16, 1,
                                 True, next(_prologues(dim)), softcap=30.0, sinks=sinks)
            write.write_rows_gpu(mx.zeros((16, 4, 8), dtype), mx.array([3, 0]),
                                 mx.zeros((2, 4, 8), dtype), dialect=dialect)
            for name in SUPPORTED_KV_CACHE_DTYPES[1:]:
                for dim in (64, 96, 128, 256):
                    fmt = kv_format(name, dim)
                    signs = rht_signs(dim) if fmt.rotated else None
                    pool = mx.zeros((16, kv_heads, fmt.cell_bytes(dim)), mx.uint8)
                    keys = mx.zeros((tokens, kv_heads, dim), dtype)
                    quant_write.write_kv_quant_gpu(pool, slots, keys, keys, fmt, signs,
                                                   dialect=dialect)
                    for group in (1, 4):
                        q = mx.zeros((tokens, kv_heads * group, 1, dim), dtype)
                        paged_quant.launch(dialect, q, pool, tables, decode_lens, 0.5, None,
                                           16, 1, True, fmt, signs)
                        rows = paged_quant.q_tile(group, dim, fmt.rotated)
                        paged_quant.launch(dialect, q, pool, tables, prefill_tiles, 0.5, 16,
                                           16, rows, False, fmt, signs)
                        paged_quant.launch(dialect, q, pool, tables, decode_lens, 0.5, None,
                                           16, 1, True, fmt, signs, softcap=30.0,
                                           sinks=mx.zeros((kv_heads * group,), mx.float32))
    for dtype in (mx.bfloat16, mx.float16):
        x = mx.zeros((5, 64), dtype)
        for sizes in ([32], [32, 16], [16, 32, 48]):
            w = mx.zeros((sum(sizes), 64), dtype)
            for bias in (None, mx.zeros((sum(sizes),), dtype)):
                assert gpu_gemm.gemm(x, w, sizes, bias) is not None


def record() -> list[Instance]:
    """Every kernel object the wrappers build over this module's grid, in build order."""
    with _recording() as instances:
        _drive()
    return instances


def main() -> int:
    instances = record()
    total = hashlib.sha256()
    for inst in instances:
        line = (f"{inst.dialect} {inst.name} {','.join(inst.input_names)} -> "
                f"{','.join(inst.output_names)} {inst.digest()}")
        print(line)
        total.update(line.encode())
        if inst.metal_calls:
            line = (f"  metal calls of {inst.name}: {len(inst.metal_calls)} distinct texts "
                    f"{inst.calls_digest()}")
            print(line)
            total.update(line.encode())
    print(f"{len(instances)} kernel objects, total {total.hexdigest()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
