"""Which MLX backend this process runs on, and the memory facts that follow from it.

Three parts, on purpose:

* :func:`detect_backend` answers from installed distributions and the OS alone. vLLM calls the
  platform in its API-server process *before* it forks the engine core, and MLX is not fork-safe
  (a forked child hangs in its first ``mx.eval``), so it imports no ``mlx``.
* :func:`import_mlx` is for the engine-core/worker process: it interposes a fast BLAS first
  (see :mod:`vllm_unified.blas`), imports ``mlx.core`` and selects the device.
* :func:`profile` is the one decision, in the worker process, of everything that depends on
  the backend: where MLX's buffers live, how the KV pool is owned and written, which attention
  kernels run, how logits reach torch, whether quantized weights stay quantized. It is made
  once per process; every module that needs one of these answers reads it from the profile.
"""

from __future__ import annotations

import functools
import importlib.metadata
import os
import platform
import shutil
import subprocess
import sys
from dataclasses import dataclass
from types import ModuleType
from typing import Literal

import psutil

from vllm_unified import envs
from vllm_unified.blas import preload_blas

BackendKind = Literal["metal", "cuda", "cpu"]

#: Environment variable forcing the backend: ``metal``, ``cuda`` or ``cpu``.
DEVICE_ENV = envs.DEVICE_ENV


@dataclass(frozen=True)
class BackendInfo:
    """Facts about the MLX backend, known without importing MLX.

    Attributes:
        kind: ``"metal"`` (Apple GPU), ``"cuda"`` (NVIDIA GPU) or ``"cpu"``.
        device_name: human-readable device name for logs and ``get_device_name``.
        total_memory: bytes the device can address. Unified backends (Metal, CPU) report the
            machine's RAM (``psutil.virtual_memory().total``); CUDA reports the card's memory.
        unified: whether device memory is the host's RAM (then pinned memory is meaningless).
        reason: how the kind was chosen (override, installed wheel, fallback), for the log.
    """

    kind: BackendKind
    device_name: str
    total_memory: int
    unified: bool
    reason: str


def _installed(dist: str) -> bool:
    try:
        importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def _cuda_total_memory() -> int | None:
    """Memory of GPU 0 in bytes from ``nvidia-smi``; None when it cannot be asked."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        out = subprocess.run(
            [exe, "--query-gpu=memory.total", "--format=csv,noheader,nounits", "-i", "0"],
            capture_output=True, text=True, timeout=10, check=True,
        ).stdout
        return int(out.strip().splitlines()[0]) * 1024 * 1024  # MiB -> bytes
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None


def _cpu_name() -> str:
    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    name = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{name} ({os.cpu_count()} cores)"


@functools.cache
def detect_backend() -> BackendInfo:
    """Choose the MLX backend: Metal GPU, else CUDA GPU, else CPU.

    ``VLLM_UNIFIED_DEVICE`` overrides the choice.

    Raises:
        ValueError: ``VLLM_UNIFIED_DEVICE`` holds something other than metal/cuda/cpu, or names
            a backend whose MLX wheel is not installed.
    """
    ram = psutil.virtual_memory().total
    has_metal = sys.platform == "darwin" and _installed("mlx-metal")
    has_cuda = _installed("mlx-cuda-13") or _installed("mlx-cuda-12")
    forced = envs.read(DEVICE_ENV) or ""
    if forced == "metal" and not has_metal:
        raise ValueError(f"{DEVICE_ENV}=metal but MLX's Metal backend (mlx-metal) is not installed")
    if forced == "cuda" and not has_cuda:
        raise ValueError(f"{DEVICE_ENV}=cuda but MLX's CUDA backend (mlx[cuda13]) is not installed")

    kind: BackendKind
    if forced:
        kind, reason = forced, f"{DEVICE_ENV}={forced}"  # type: ignore[assignment]
    elif has_metal:
        kind, reason = "metal", "mlx-metal installed on macOS"
    elif has_cuda:
        kind, reason = "cuda", "mlx-cuda installed"
    else:
        kind, reason = "cpu", "no MLX GPU backend installed"

    if kind == "metal":
        return BackendInfo("metal", f"Apple GPU ({platform.machine()})", ram, True, reason)
    if kind == "cuda":
        total = _cuda_total_memory()
        if total is None:  # Exact figure comes from mx.device_info() in the worker.
            total = ram
        return BackendInfo("cuda", "NVIDIA GPU", total, False, reason)
    return BackendInfo("cpu", _cpu_name(), ram, True, reason)


#: MLX's CUDA backend closes a CUDA graph after ``MLX_MAX_OPS_PER_BUFFER`` operations (100 on
#: H100/H200) or once the input bytes of its operations pass ``MLX_MAX_MB_PER_BUFFER`` (1,000
#: MB there); every kernel input counts, each time it is read (``CommandEncoder::
#: set_input_array``, ``mlx/backend/cuda/device.cpp``). A layer's KV pool array (hundreds of
#: MB, read by the KV write and the attention kernel) thus closes a graph at every layer: a
#: decode step becomes one small graph per layer, each updated and launched on its own. The
#: pool is no temporary the limit could free early, so on CUDA the byte limit is lifted and the
#: operation count alone closes graphs (the activation peak is profiled with it in effect).
MLX_GRAPH_MB_ENV = "MLX_MAX_MB_PER_BUFFER"
CUDA_GRAPH_MAX_MB = 1 << 20


def set_mlx_env_defaults() -> None:
    """Set the MLX environment defaults of this backend (before MLX makes its first stream;
    MLX reads them once): on CUDA, ``MLX_MAX_MB_PER_BUFFER`` (see :data:`CUDA_GRAPH_MAX_MB`),
    unless the user set it (the value in effect is in the profile's start-up line). Imports
    nothing of MLX.

    Raises:
        ValueError: as :func:`detect_backend`.
    """
    if detect_backend().kind == "cuda":
        os.environ.setdefault(MLX_GRAPH_MB_ENV, str(CUDA_GRAPH_MAX_MB))


@functools.cache
def import_mlx() -> ModuleType:
    """Import ``mlx.core`` for compute in this process and select the backend's device.

    Call this (never ``import mlx.core`` directly) in the worker before anything touches MLX:
    on the CPU backend it first interposes a fast BLAS, which only works before MLX is loaded.

    Returns:
        The ``mlx.core`` module.
    """
    info = detect_backend()
    set_mlx_env_defaults()
    if info.kind == "cpu":
        preload_blas()
    import mlx.core as mx  # lazy: the BLAS interposition must precede it; no MLX before a fork

    mx.set_default_device(mx.gpu if info.kind in ("metal", "cuda") else mx.cpu)
    return mx


KVPoolMemory = Literal["torch_shared", "mlx_owned"]
KVWritePath = Literal["native_rows", "metal_kernel", "cuda_kernel", "scatter"]
GpuDialect = Literal["cuda", "metal"]


@dataclass(frozen=True)
class BackendProfile:
    """Everything that depends on the backend, decided once per worker process.

    Attributes:
        info: the backend (:func:`detect_backend`).
        allocator: where MLX's buffers live, from the MLX build (``mx.metal`` / ``mx.cuda``
            availability), which is not always ``info.kind``: with a GPU build and
            ``VLLM_UNIFIED_DEVICE=cpu``, arrays made for the CPU still live in GPU-backend
            memory.
        kv_pool: ``"torch_shared"``: the KV pool is vLLM's layout in a torch buffer that MLX
            adopts without a copy (MLX's CPU buffers with the native extension; Metal, whose
            ``from_dlpack(copy=False)`` wraps page-aligned host memory as a shared Metal
            buffer); ``"mlx_owned"``: MLX allocates the pool (torch cannot share it).
        kv_pool_reason: why the pool is MLX-owned (None when it is shared), for the log and
            for the errors of features that need the shared pool.
        kv_write: how rows go into the pool (attention rows and a hybrid model's state
            pages): the native ``write_rows`` primitive (shared pool on the CPU), the in-place
            Metal kernels (shared pool on Metal, :mod:`vllm_unified.kv.gpu.write`), the
            in-place CUDA kernel (MLX-owned pool on CUDA, whose scatter would copy the pool),
            or MLX's donated scatter.
        cpu_kernels: the native CPU kernels apply (CPU compute on CPU buffers, extension
            built): linears, norms, RoPE, SwiGLU (:mod:`vllm_unified.models.cpu_kernels`).
        cpu_attention: the native CPU kernel attends every row (``cpu_kernels`` and
            ``VLLM_UNIFIED_CPU_ATTENTION`` not 0).
        gpu_attention: the dialect (``"cuda"`` or ``"metal"``) of the paged GPU attention
            kernel that takes every row of head sizes it supports (GPU compute on that
            backend, ``VLLM_UNIFIED_GPU_ATTENTION`` not 0), else None (the reference).
        fuse_projections: q/k/v and gate/up projections run as one matmul each (GPU compute,
            where a step is bound by host work per primitive; the native CPU kernels, for
            one-row inputs, where each kernel call costs a dispatch to the kernel threads;
            ``VLLM_UNIFIED_FUSE_PROJECTIONS``; :mod:`vllm_unified.models.fused_projections`).
        gpu_gemm: matmuls of 2 to 64 rows (decode steps) run the small tensor-core kernel of
            :mod:`vllm_unified.models.gpu_gemm` instead of MLX's cuBLASLt path, whose host
            cost per call bounds a decode step (CUDA compute; ``VLLM_UNIFIED_GPU_GEMM``).
        fused_qk: in pure-decode steps the per-head query/key norms and RoPE of the layers
            that have them run inside the KV write and paged attention kernels
            (:mod:`vllm_unified.models.decode_attention`; GPU compute with both kernels;
            ``VLLM_UNIFIED_FUSED_QK``).
        encode_thread: with asynchronous scheduling, queued steps are evaluated on a thread
            of their own while vLLM's engine runs its Python
            (:mod:`vllm_unified.worker.encode_thread`; ``VLLM_UNIFIED_ENCODE_THREAD``, default
            CUDA only: measured there; on Metal it needs a Mac to be checked).
        compile_decode: pure-decode steps may run as one compiled graph (where the write path
            and decode kernel allow; ``VLLM_UNIFIED_COMPILE_DECODE``).
        logits_zero_copy: logits reach torch as a view (MLX buffers in CPU memory), not a
            copy.
        keep_quantized: quantized checkpoints stay quantized on every dtype (GPU backends,
            whose quantized matmuls are fast); on the CPU the native kernels decide per dtype.
    """

    info: BackendInfo
    allocator: BackendKind
    kv_pool: KVPoolMemory
    kv_pool_reason: str | None
    kv_write: KVWritePath
    cpu_kernels: bool
    cpu_attention: bool
    gpu_attention: GpuDialect | None
    fuse_projections: bool
    gpu_gemm: bool
    fused_qk: bool
    encode_thread: bool
    compile_decode: bool
    logits_zero_copy: bool
    keep_quantized: bool

    @property
    def kind(self) -> BackendKind:
        return self.info.kind

    @property
    def quantized_kv(self) -> Literal["native", "metal", "cuda"] | None:
        """Which kernels write and read a quantized KV cache (``--kv-cache-dtype``
        ``*_per_token_head``; :mod:`vllm_unified.kv.quant`), None where none does:
        ``"native"``: the native CPU kernels (CPU attention over the torch-shared pool);
        ``"metal"`` / ``"cuda"``: the GPU kernels of that dialect, where the profile writes
        the pool with them and attends with the paged GPU kernel (Metal: the torch-shared
        pool written by the Metal kernels; CUDA: the MLX-owned pool written by the CUDA
        kernel). Head sizes are the kernels' own limit (the KV cache checks them)."""
        if self.cpu_attention and self.kv_pool == "torch_shared":
            return "native"
        if (self.gpu_attention == "metal" and self.kv_pool == "torch_shared"
                and self.kv_write == "metal_kernel"):
            return "metal"
        if (self.gpu_attention == "cuda" and self.kv_pool == "mlx_owned"
                and self.kv_write == "cuda_kernel"):
            return "cuda"
        return None

    def describe(self) -> str:
        """One line for the start-up log."""
        attention = ("native CPU kernel" if self.cpu_attention else
                     f"paged GPU kernel ({self.gpu_attention})" if self.gpu_attention
                     else "MLX reference")
        pool = ("vLLM layout in torch memory, shared with MLX" if self.kv_pool == "torch_shared"
                else f"MLX-owned ({self.kv_pool_reason})")
        text = (f"MLX {self.kind} backend (buffers: {self.allocator}); KV pool {pool}, written "
                f"by {self.kv_write.replace('_', ' ')}; attention: {attention}; logits to torch "
                f"{'as a view' if self.logits_zero_copy else 'by copy'}")
        if self.gpu_gemm:
            text += "; matmuls of 2-64 rows by the GPU kernel"
        if self.fused_qk:
            text += "; decode q/k norms and RoPE inside the KV write and attention kernels"
        if self.kind == "cuda":
            text += f"; {MLX_GRAPH_MB_ENV}={os.environ.get(MLX_GRAPH_MB_ENV, '(MLX default)')}"
        return text


@functools.cache
def mlx_allocator() -> BackendKind:
    """Which allocator MLX's buffers come from: decided by the MLX build, not the default
    device (imports MLX)."""
    mx = import_mlx()
    if mx.metal.is_available():
        return "metal"
    if mx.cuda.is_available():
        return "cuda"
    return "cpu"


@functools.cache
def native_extension() -> tuple[ModuleType | None, str | None]:
    """The native extension (distribution ``vllm-unified-native``, built from ``native/``) and
    None, or None and why it cannot be imported. Imports MLX first (:func:`import_mlx`): the
    extension links against ``mlx.core``."""
    try:
        import_mlx()
        import vllm_unified_native  # it imports mlx.core: after the BLAS interposition
    except ImportError as exc:
        return None, f"{type(exc).__name__}: {exc}"
    return vllm_unified_native, None


@functools.cache
def profile() -> BackendProfile:
    """The backend profile of this process (imports MLX; worker process only).

    Raises:
        ValueError: a ``VLLM_UNIFIED_*`` setting it reads does not parse.
    """
    info = detect_backend()
    allocator = mlx_allocator()
    on_cpu = info.kind == "cpu" and allocator == "cpu"  # CPU compute on CPU buffers
    on_metal = info.kind == "metal" and allocator == "metal"
    if on_cpu:
        reason = native_extension()[1]
    elif on_metal:
        reason = None  # mx.from_dlpack(copy=False) adopts page-aligned torch CPU memory
    elif info.kind == "cpu":
        reason = f"MLX's buffers are {allocator} memory (a GPU build of MLX)"
    else:
        reason = f"MLX's {info.kind} buffers cannot be shared with torch here"
    shared = reason is None
    if on_metal:
        write: KVWritePath = "metal_kernel"
    elif shared:
        write = "native_rows"
    elif info.kind == "cuda":
        write = "cuda_kernel"
    else:
        write = "scatter"
    cpu_kernels = on_cpu and reason is None
    cpu_attention = cpu_kernels and envs.CPU_ATTENTION
    gpu = info.kind in ("cuda", "metal") and allocator == info.kind  # GPU compute
    return BackendProfile(
        info=info, allocator=allocator,
        kv_pool="torch_shared" if shared else "mlx_owned", kv_pool_reason=reason,
        kv_write=write, cpu_kernels=cpu_kernels, cpu_attention=cpu_attention,
        gpu_attention=info.kind if gpu and envs.GPU_ATTENTION else None,
        fuse_projections=(gpu or cpu_kernels) and envs.FUSE_PROJECTIONS,
        gpu_gemm=gpu and info.kind == "cuda" and envs.GPU_GEMM,
        fused_qk=(gpu and envs.GPU_ATTENTION and write in ("cuda_kernel", "metal_kernel")
                  and envs.FUSED_QK),
        encode_thread=(envs.ENCODE_THREAD if envs.ENCODE_THREAD is not None
                       else gpu and info.kind == "cuda"),
        compile_decode=envs.COMPILE_DECODE,
        logits_zero_copy=allocator == "cpu",
        keep_quantized=info.kind != "cpu",
    )
