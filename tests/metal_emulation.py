"""Run the Metal source MLX would compile on the CPU, emulating Metal's thread model (tests).

:func:`run` takes a kernel's complete Metal source as ``mx.fast.metal_kernel`` builds it
(:func:`vllm_unified.gpu_dialect.assemble_metal`), compiles it with clang++ against
``tests/metal_shim/`` (a small stand-in of ``<metal_stdlib>`` and MLX's prelude) plus a driver
generated from the kernel's signature, and runs it over the grid: one threadgroup after another,
each thread a cooperatively scheduled fiber, SIMD groups of 32 lanes that exchange values in the
SIMD-group functions, barriers that wait for the whole threadgroup, and the thread attributes
(``thread_position_in_grid`` ...) computed as Metal's ``dispatchThreads`` does with MLX's
threadgroup ``min(threadgroup, grid)`` (the last group of a dimension is smaller when the grid
is not a multiple). Divergent SIMD functions and barriers are errors (``EmulationError``).
Each run is a forked child process over shared memory: every buffer ends against an
inaccessible page, so a write or read past its end faults, and the fault, like a kernel that
does not finish, is reported as an error instead of taking the test process down.

What it checks: the text is valid C++ against the shim (names, types, template arguments,
the attribute parameters MLX added) and the kernel's logic is right under this thread model.
What it cannot: Apple's compiler and stdlib, address-space rules, the GPU's scheduling and
memory ordering, fast-math precision (docs/dev/gpu-and-metal-checks.md).

The one edit made to MLX's text: the explicit instantiation
``template [[host_name("f")]] [[kernel]] decltype(f<...>) f<...>;`` loses its two attribute
lists, which standard C++ does not allow there. Compiled libraries are cached by the hash of the
source, the shim and this file, under ``$METAL_EMULATION_CACHE`` or ``<repo>/tmp/metal_emulation``,
beside the shim's precompiled header.
"""

from __future__ import annotations

import ctypes
import hashlib
import mmap
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from vllm_unified.gpu_dialect import METAL_ATTRIBUTES

SHIM = Path(__file__).resolve().parent / "metal_shim"
CXX_FLAGS = ("-std=c++17", "-O1", "-fPIC", "-shared", "-fvisibility=hidden",
             "-Wno-unknown-attributes", "-Werror=return-type")

# Metal type string -> (numpy storage dtype, the dtype results are returned in)
_TYPES: dict[str, tuple[np.dtype, np.dtype]] = {
    "float": (np.dtype(np.float32),) * 2,
    "float16_t": (np.dtype(np.float16),) * 2,
    "bfloat16_t": (np.dtype(np.uint16), np.dtype(np.float32)),  # bits; returned as float32
    "bool": (np.dtype(np.bool_),) * 2,
    **{f"{k}{n}_t": (np.dtype(f"{k}{n}"),) * 2 for k in ("int", "uint") for n in (8, 16, 32, 64)},
}
_MX_TYPES = {mx.float32: "float", mx.float16: "float16_t", mx.bfloat16: "bfloat16_t",
             mx.bool_: "bool", mx.int8: "int8_t", mx.int16: "int16_t", mx.int32: "int32_t",
             mx.int64: "int64_t", mx.uint8: "uint8_t", mx.uint16: "uint16_t",
             mx.uint32: "uint32_t", mx.uint64: "uint64_t"}
_ATTRIBUTE_TYPES = dict(METAL_ATTRIBUTES)

_PARAM = re.compile(
    r"^  (?P<type>[^\[]+?) (?P<name>\w+) \[\[(?P<attr>\w+)(?:\((?P<index>\d+)\))?\]\]")
_INSTANTIATION = re.compile(
    r'^template \[\[host_name\("(?P<host>\w+)"\)\]\] \[\[kernel\]\] '
    r"(?P<decl>decltype\((?P<call>(?P<func>\w+)<[^;]*>)\) (?P=call);)$", re.M)


class EmulationError(RuntimeError):
    """The kernel did not compile, or broke the thread model while running."""


def clang() -> str | None:
    """Path of clang++, or None when it is not installed."""
    return shutil.which("clang++")


#: marks a test that runs kernels through the emulation (skipped, saying why, without clang++)
needs_clang = pytest.mark.skipif(
    clang() is None,
    reason="clang++ is not installed (the Metal emulation compiles kernels with it; "
           "scripts/setup.sh installs clang on Debian/Ubuntu)")


@dataclass(frozen=True)
class Param:
    type: str
    name: str
    attr: str  # "buffer" or the thread attribute
    index: int | None


@dataclass(frozen=True)
class Signature:
    func: str
    call: str  # what the driver calls: func or func<template arguments>
    params: tuple[Param, ...]


def parse(source: str) -> Signature:
    """The kernel function, its parameters and the instantiation to call, from MLX's text.

    Raises:
        EmulationError: no ``[[kernel]]`` function, an unexpected parameter line, buffer
            indices out of order, or a thread attribute MLX does not know or mistypes.
    """
    m = re.search(r"^\[\[kernel\]\] void (\w+)\(\n", source, re.M)
    if m is None:
        raise EmulationError("no [[kernel]] function in the source")
    func, params = m.group(1), []
    for line in source[m.end():].splitlines():
        p = _PARAM.match(line)
        if p is None:
            raise EmulationError(f"unexpected parameter line {line!r}")
        index = None if p["index"] is None else int(p["index"])
        params.append(Param(p["type"].strip(), p["name"], p["attr"], index))
        if line.endswith(") {"):
            break
    buffers = [q.index for q in params if q.attr == "buffer"]
    if buffers != list(range(len(buffers))):
        raise EmulationError(f"buffer indices {buffers} are not 0, 1, ...")
    for q in params:
        if q.attr != "buffer" and (q.attr != q.name or _ATTRIBUTE_TYPES.get(q.name) != q.type):
            raise EmulationError(f"parameter {q} is no Metal thread attribute MLX passes")
    inst = list(_INSTANTIATION.finditer(source))
    templated = source[:m.start()].rstrip("\n").rsplit("\n", 1)[-1].startswith("template <")
    if templated or inst:
        if not templated or len(inst) != 1 or inst[0]["host"] != func or inst[0]["func"] != func:
            raise EmulationError(f"expected one explicit instantiation of {func}")
        return Signature(func, inst[0]["call"], tuple(params))
    return Signature(func, func, tuple(params))


def _translation_unit(source: str, sig: Signature) -> str:
    body = _INSTANTIATION.sub(lambda m: "template " + m["decl"], source)
    args, k = [], 0
    for q in sig.params:
        if q.attr == "buffer":
            ref = q.type.endswith("&")
            ptr = q.type[:-1] + "*" if ref else q.type
            args.append(f"{'*' if ref else ''}({ptr})uni_buffers[{k}]")
            k += 1
        else:
            args.append(f"c.{q.name}")
    joined = ",\n      ".join(args)
    return f"""#include "mlx_utils.h"
#line 1 "kernel.metal"
{body}
#line 1 "uni_emu_driver.cpp"
static void* const* uni_buffers = nullptr;
static void uni_thread_body(const uni_emu::ThreadCtx& c) {{
  (void)c;
  {sig.call}(
      {joined});
}}
extern "C" __attribute__((visibility("default"))) int uni_emu_run(
    void* const* bufs, const unsigned* grid, const unsigned* tg, char* err, int errlen) {{
  uni_buffers = bufs;
  return uni_emu::run(uni_thread_body, grid, tg, err, errlen);
}}
"""


def _cache_dir() -> Path:
    env = os.environ.get("METAL_EMULATION_CACHE")
    return Path(env) if env else Path(__file__).resolve().parents[1] / "tmp" / "metal_emulation"


_LOADED: dict[str, ctypes.CDLL] = {}


def _shim_pch(cxx: str) -> Path:
    """The shim's prelude (``mlx_utils.h`` and what it includes) precompiled once per shim and
    flags, so that each kernel's compile skips parsing the C++ headers (most of its time).

    Raises:
        EmulationError: clang++ cannot precompile the shim (its diagnostics in the message).
    """
    digest = hashlib.sha256(" ".join(CXX_FLAGS).encode())
    for part in sorted(SHIM.iterdir()):
        if part.is_file():
            digest.update(part.read_bytes())
    pch = _cache_dir() / f"pch-{digest.hexdigest()[:32]}" / "mlx_utils.h.pch"
    if pch.exists():
        return pch
    pch.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=pch.parent, suffix=".pch")
    os.close(fd)
    flags = [f for f in CXX_FLAGS if f != "-shared"]
    proc = subprocess.run([cxx, *flags, "-I", str(SHIM), "-x", "c++-header",
                           str(SHIM / "mlx_utils.h"), "-o", tmp], capture_output=True, text=True)
    if proc.returncode:
        os.unlink(tmp)
        raise EmulationError(f"clang++ failed to precompile {SHIM / 'mlx_utils.h'}:\n{proc.stderr}")
    os.replace(tmp, pch)  # atomic: parallel test processes may build it at once
    return pch


def build(source: str) -> tuple[Signature, ctypes.CDLL]:
    """Compile (or load from the cache) the emulation library of a Metal source.

    Raises:
        EmulationError: clang++ missing, or the source does not compile (its diagnostics
            in the message).
    """
    sig = parse(source)
    unit = _translation_unit(source, sig)
    digest = hashlib.sha256()
    for part in (unit, " ".join(CXX_FLAGS), Path(__file__).read_text(),
                 *(p.read_text() for p in sorted(SHIM.iterdir()) if p.is_file())):
        digest.update(part.encode())
    key = digest.hexdigest()[:32]
    if key in _LOADED:
        return sig, _LOADED[key]
    lib_path = _cache_dir() / key / "kernel.so"
    if not lib_path.exists():
        cxx = clang()
        if cxx is None:
            raise EmulationError("clang++ is not installed")
        lib_path.parent.mkdir(parents=True, exist_ok=True)
        (lib_path.parent / "kernel.cpp").write_text(unit)
        fd, tmp = tempfile.mkstemp(dir=lib_path.parent, suffix=".so")
        os.close(fd)
        pch = _shim_pch(cxx)
        proc = subprocess.run([cxx, *CXX_FLAGS, "-include-pch", str(pch), "-I", str(SHIM),
                               "-x", "c++", "-", "-o", tmp],
                              input=unit, capture_output=True, text=True)
        if proc.returncode:
            os.unlink(tmp)
            raise EmulationError(f"clang++ failed on {lib_path.parent / 'kernel.cpp'}:\n"
                                 f"{proc.stderr}")
        os.replace(tmp, lib_path)  # atomic: parallel test processes may build the same one
    lib = ctypes.CDLL(str(lib_path))
    lib.uni_emu_run.restype = ctypes.c_int
    lib.uni_emu_run.argtypes = (ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_uint),
                                ctypes.POINTER(ctypes.c_uint), ctypes.c_char_p, ctypes.c_int)
    _LOADED[key] = lib
    return sig, lib


def _as_buffer(x: np.ndarray | mx.array) -> tuple[np.ndarray, str]:
    """(row-contiguous storage copy, Metal type string) of an input."""
    if isinstance(x, mx.array):
        kind = _MX_TYPES[x.dtype]
        data = np.array(x.view(mx.uint16) if x.dtype == mx.bfloat16 else x)
    else:
        data = np.array(x)
        kind = next((k for k, (store, _) in _TYPES.items()
                     if store == data.dtype and k != "bfloat16_t"), None)
        if kind is None:
            raise TypeError(f"no Metal type for numpy dtype {data.dtype}")
    return np.ascontiguousarray(data), kind


def _result(data: np.ndarray, kind: str) -> np.ndarray:
    if kind == "bfloat16_t":
        return (data.astype(np.uint32) << 16).view(np.float32)
    return data


def _element_type(param_type: str) -> str:
    words = param_type.rstrip("*&").split()
    return words[-1][len("atomic<"):-1] if words[-1].startswith("atomic<") else words[-1]


def run(source: str, inputs: Sequence[np.ndarray | mx.array],
        output_shapes: Sequence[Sequence[int]], output_dtypes: Sequence[mx.Dtype],
        grid: tuple[int, int, int], threadgroup: tuple[int, int, int], *,
        init_value: float | None = None, timeout: float = 120.0
        ) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Run a kernel's Metal source on the CPU.

    Args:
        source: the complete source (:func:`vllm_unified.gpu_dialect.assemble_metal`).
        inputs: in ``input_names`` order; numpy arrays, or MLX arrays (needed for bfloat16).
            Each is copied row-contiguous, as MLX's ``ensure_row_contiguous`` does.
        output_shapes, output_dtypes, grid, threadgroup, init_value: as for the MLX kernel
            call. Without ``init_value`` outputs start as all-ones bytes (NaN, -1), so an
            element the kernel does not write shows.
        timeout: seconds the run may take.

    Returns:
        ``(inputs, outputs)`` after the run as numpy arrays (inputs the kernel wrote in place
        show the writes); bfloat16 comes back as float32 (exact).

    Raises:
        EmulationError: compile error, a broken thread-model rule, a crash (an access past a
            buffer's end), a run over ``timeout``, or arguments that do not match the
            signature.
    """
    sig, lib = build(source)
    ins = [_as_buffer(x) for x in inputs]
    outs = []
    for shape, dtype in zip(output_shapes, output_dtypes, strict=True):
        kind = _MX_TYPES[dtype]
        arr = np.empty(tuple(shape), _TYPES[kind][0])
        if init_value is None:
            arr.view(np.uint8)[...] = 0xFF
        else:
            arr[...] = (np.array(init_value, np.float32).view(np.uint32) >> 16).astype(np.uint16) \
                if kind == "bfloat16_t" else init_value
        outs.append((arr, kind))

    buffers: list[np.ndarray] = []
    params = [q for q in sig.params if q.attr == "buffer"]
    pos = 0
    for data, kind in ins:
        if pos >= len(params) or _element_type(params[pos].type) != kind:
            raise EmulationError(f"input {len(buffers)} ({kind}) does not match parameter "
                                 f"{params[pos] if pos < len(params) else None}")
        name = params[pos].name
        buffers.append(data)
        pos += 1
        extra = {"_shape": np.array(data.shape, np.int32),
                 "_strides": (np.array(data.strides, np.int64) // max(data.itemsize, 1)),
                 "_ndim": np.array([data.ndim], np.int32)}
        while pos < len(params) and data.ndim > 0 and params[pos].name.startswith(name + "_") \
                and params[pos].name[len(name):] in extra:
            buffers.append(np.ascontiguousarray(extra[params[pos].name[len(name):]]))
            pos += 1
    for arr, kind in outs:
        if pos >= len(params) or _element_type(params[pos].type) != kind:
            raise EmulationError(f"output ({kind}) does not match parameter "
                                 f"{params[pos] if pos < len(params) else None}")
        buffers.append(arr)
        pos += 1
    if pos != len(params):
        raise EmulationError(f"{len(params) - pos} buffer parameters left without an array")

    guarded = [_Guarded(b) for b in buffers]
    try:
        _run_child(lib, [g.ptr for g in guarded], grid, threadgroup, timeout)
        for g, b in zip(guarded, buffers, strict=True):
            b[...] = g.array()
    finally:
        for g in guarded:
            g.close()
    return ([_result(d, k) for d, k in ins], [_result(a, k) for a, k in outs])


_LIBC = ctypes.CDLL(None, use_errno=True)
_LIBC.mmap.restype = ctypes.c_void_p
_LIBC.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                       ctypes.c_int, ctypes.c_long)
_LIBC.mprotect.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
_LIBC.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
_PAGE = mmap.PAGESIZE


class _Guarded:
    """One array's bytes in shared anonymous memory (a forked child's writes show here),
    ending exactly where an inaccessible page begins."""

    def __init__(self, data: np.ndarray) -> None:
        self.dtype, self.shape, self.nbytes = data.dtype, data.shape, data.nbytes
        pages = -(-self.nbytes // _PAGE)
        self.size = (pages + 1) * _PAGE
        base = _LIBC.mmap(None, self.size, mmap.PROT_READ | mmap.PROT_WRITE,
                          mmap.MAP_SHARED | mmap.MAP_ANONYMOUS, -1, 0)
        if base in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), "mmap failed")
        self.base = base
        if _LIBC.mprotect(base + pages * _PAGE, _PAGE, 0):
            raise OSError(ctypes.get_errno(), "mprotect failed")
        self.ptr = base + pages * _PAGE - self.nbytes
        self.array()[...] = data

    def array(self) -> np.ndarray:
        raw = (ctypes.c_ubyte * self.nbytes).from_address(self.ptr)
        return np.frombuffer(raw, self.dtype).reshape(self.shape)

    def close(self) -> None:
        _LIBC.munmap(self.base, self.size)


def _run_child(lib: ctypes.CDLL, ptrs: list[int], grid: tuple[int, int, int],
               threadgroup: tuple[int, int, int], timeout: float) -> None:
    message = _Guarded(np.zeros(4096, np.uint8))
    args = ((ctypes.c_void_p * max(len(ptrs), 1))(*ptrs), (ctypes.c_uint * 3)(*grid),
            (ctypes.c_uint * 3)(*threadgroup), ctypes.c_char_p(message.ptr), 4096)
    pid = os.fork()
    if pid == 0:  # the child: run the kernel and leave, touching nothing else
        code = 3
        try:
            code = lib.uni_emu_run(*args)
        finally:
            os._exit(code)
    deadline, pause = time.monotonic() + timeout, 0.0005
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            raise EmulationError(f"the kernel did not finish within {timeout} s "
                                 "(an endless loop, or threads waiting on each other)")
        time.sleep(pause)
        pause = min(pause * 2, 0.05)
    raw = message.array().tobytes()
    message.close()
    text = raw[:raw.index(0)].decode(errors="replace") if 0 in raw else raw.decode()
    if os.WIFSIGNALED(status):
        name = signal.Signals(os.WTERMSIG(status)).name
        raise EmulationError(f"the kernel crashed ({name}); an access past the end of a "
                             "buffer faults on the page after it")
    if os.WEXITSTATUS(status):
        raise EmulationError(text or f"the emulation exited with {os.WEXITSTATUS(status)}")
