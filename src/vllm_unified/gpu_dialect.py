"""GPU kernels written once, instantiated for MLX's CUDA or Metal backend.

A kernel body is one string that uses only the names below (and plain C++ both dialects share:
``int64_t``, ``static_cast``, arithmetic, the template arguments, ``name_shape[i]``), and is
instantiated for a dialect, ``"cuda"`` (``mx.fast.cuda_kernel``) or ``"metal"``
(``mx.fast.metal_kernel``). Each dialect adds a header (passed as the kernel's ``header=``, before
the kernel's own header) and a body prefix (prepended to the body inside the generated function:
MLX's Metal assembly scans the *body text* for attribute names such as
``thread_position_in_grid`` to decide which parameters the signature gets, so the prefix must
live in the body). The prefix declares only the ``uni_*`` indices the body mentions.

========================  =============================================  ===========================
name                      metal                                          cuda
========================  =============================================  ===========================
``uni_global`` (uint64)   ``thread_position_in_grid.x``                  ``blockIdx.x*blockDim.x+
                                                                         threadIdx.x``
``uni_group`` (uint)      ``threadgroup_position_in_grid.x``             ``blockIdx.x``
``uni_thread`` (uint)     ``thread_position_in_threadgroup.x``           ``threadIdx.x``
``uni_threads`` (uint)    ``threads_per_threadgroup.x``                  ``blockDim.x``
``uni_lane`` (uint)       ``thread_index_in_simdgroup``                  ``threadIdx.x % 32``
``uni_simd`` (uint)       ``simdgroup_index_in_threadgroup``             ``threadIdx.x / 32``
``UNI_DEVICE``            ``device``                                     (empty)
``UNI_SHARED``            ``threadgroup``                                ``__shared__``
``UNI_BARRIER()``         ``threadgroup_barrier(mem_flags::mem_          ``__syncthreads()``
                          threadgroup)``
``uni_simd_sum(float)``   ``simd_sum``                                   xor-shuffle butterfly
``uni_simd_max(float)``   ``simd_max``                                   xor-shuffle butterfly
``uni_shfl_xor(f, int)``  ``simd_shuffle_xor``                           ``__shfl_xor_sync``
``uni_exp(float)``        ``metal::fast::exp``                           ``__expf``
``uni_fmax(f, f)``        ``metal::max``                                 ``fmaxf``
``uni_rsqrt(float)``      ``metal::precise::rsqrt``                      ``rsqrtf``
``uni_cos(float)``        ``metal::precise::cos``                        ``cosf``
``uni_sin(float)``        ``metal::precise::sin``                        ``sinf``
``uni_tanh(float)``       ``metal::precise::tanh``                       ``tanhf``
``uni_neg_inf()``         ``-INFINITY``                                  ``__int_as_float(
                                                                         0xff800000)``
``UNI_WRITABLE(T, p)``    ``const_cast<device T*>(p)``                   ``const_cast<T*>(p)``
``UNI_FUNC``              ``inline``                                     ``__device__
                                                                         __forceinline__``
``uni_as_uint(float)``    ``as_type<uint32_t>``                          ``__float_as_uint``
``uni_as_float(uint32)``  ``as_type<float>``                             ``__uint_as_float``
``uni_mul_rn(f, f)``      ``metal::fma(a, b, 0.0f)``                     ``__fmul_rn``
``uni_add_rn(f, f)``      ``a + b``                                      ``__fadd_rn``
========================  =============================================  ===========================

``UNI_FUNC`` declares a helper function of a kernel's own header (CUDA needs ``__device__``).
``uni_mul_rn`` / ``uni_add_rn`` are the IEEE product and sum, each rounded on its own: never
contracted into a fused multiply-add with a neighbouring operation (NVRTC fuses ``a * b + c`` by
default; ``__fmul_rn``/``__fadd_rn`` are documented never to be fused). On Metal the product is
an ``fma`` with ``+0.0``: one rounding of the exact product, which the compiler may neither fold
into a plain multiply (a zero product comes out ``+0``, so the sign of a zero is not kept) nor
merge with the sum that follows. Kernels whose bytes must equal another implementation's (the
quantizing KV write) use them where a product feeds a sum, where the sign of a zero does not
matter.

Both dialects' SIMD groups are 32 lanes wide (NVIDIA warps; Apple GPUs' SIMD groups). The
template type ``T`` is the array dtype (Metal ``float``/``float16_t``/``bfloat16_t``, CUDA
``float``/``__half``/``__nv_bfloat16``); convert with ``static_cast<float>`` /
``static_cast<T>``. A Metal input with fewer than 8 elements is passed in the ``constant``
address space, which ``UNI_WRITABLE`` cannot make writable: kernels that write an input must
refuse such inputs (as :mod:`vllm_unified.kv.gpu.write` does). When the grid is not a multiple
of the threadgroup, Metal's last threadgroup is smaller (``uni_threads`` is its real size) while
CUDA pads the last block: guard the tail by index, and keep grids of kernels that cooperate
within a group a multiple of the group.

**Kernel files.** Kernel text lives in files, never in Python strings: in a ``kernels/``
folder beside the module that launches it (this module's dialect headers in
``vllm_unified/kernels/gpu_dialect_{cuda,metal}.h``), read once by :func:`kernel_file` and
shipped as package data. ``NAME.h`` holds file-scope text (types, ``UNI_FUNC`` helpers), passed
as a kernel's ``header=``; ``NAME.inc`` holds statements spliced into the generated function
(a body, or a piece of one). Both are C++ to an editor, and neither compiles alone. A file is
used byte for byte, unless it is cut into sections (:func:`kernel_sections`: ``//@ NAME`` lines;
what precedes the first is a description), so a plain file has no comment of its own: MLX's
Metal assembly scans a body's text, comments included, for parameter and attribute names. What
Python fills in is an explicit placeholder ``@NAME@`` (:func:`render`, which refuses a missing
or an unused value); :func:`instance_source` refuses text with a placeholder left.

:func:`assemble_metal` reproduces in Python the Metal source MLX builds for a kernel call
(MLX 0.32.4, ``mlx/backend/common/metal_kernel.cpp``: ``metal_kernel``, ``write_signature``,
``write_template``, ``make_template_hash``; ``get_type_string`` in
``mlx/backend/common/compiled.cpp``), so the Metal instance can be compiled and checked on a
machine without Metal (``tests/metal_emulation.py``).
"""

from __future__ import annotations

import functools
import importlib.resources
import re
from collections.abc import Iterable, Sequence
from typing import Literal

import mlx.core as mx

Dialect = Literal["cuda", "metal"]
DIALECTS: tuple[Dialect, ...] = ("cuda", "metal")

# (name, metal declaration, cuda declaration), in prefix order.
_INDICES: tuple[tuple[str, str, str], ...] = (
    ("uni_global", "const ulong uni_global = thread_position_in_grid.x;",
     "const unsigned long long uni_global = "
     "(unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;"),
    ("uni_group", "const uint uni_group = threadgroup_position_in_grid.x;",
     "const unsigned int uni_group = blockIdx.x;"),
    ("uni_thread", "const uint uni_thread = thread_position_in_threadgroup.x;",
     "const unsigned int uni_thread = threadIdx.x;"),
    ("uni_threads", "const uint uni_threads = threads_per_threadgroup.x;",
     "const unsigned int uni_threads = blockDim.x;"),
    ("uni_lane", "const uint uni_lane = thread_index_in_simdgroup;",
     "const unsigned int uni_lane = threadIdx.x % 32;"),
    ("uni_simd", "const uint uni_simd = simdgroup_index_in_threadgroup;",
     "const unsigned int uni_simd = threadIdx.x / 32;"),
)


#: a placeholder of a kernel file, ``@NAME@``
_PLACEHOLDER = re.compile(r"@([A-Z][A-Z0-9_]*)@")
#: a placeholder alone on its line (from column 0), or one inside a line
_PLACEHOLDER_USE = re.compile(r"^@([A-Z][A-Z0-9_]*)@\n|@([A-Z][A-Z0-9_]*)@", re.MULTILINE)
#: the line that opens a section of a kernel file, ``//@ NAME``
_SECTION = re.compile(r"^//@ ([A-Z][A-Z0-9_]*)\n", re.MULTILINE)


@functools.cache
def kernel_file(package: str, name: str) -> str:
    """The text of the kernel file ``kernels/<name>`` of ``package`` (a dotted package name,
    the wrapper's ``__package__``), byte for byte, read once.

    Raises:
        FileNotFoundError: no such file (naming the path the package was installed with).
    """
    path = importlib.resources.files(package).joinpath("kernels", name)
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise FileNotFoundError(f"kernel file {name!r} of {package} not found at {path} "
                                "(missing from the installed package data?)") from None


def kernel_sections(text: str) -> dict[str, str]:
    """The sections of a kernel file's ``text``: each ``//@ NAME`` line opens section NAME,
    which holds the lines up to the next such line or the end (possibly none). Text before
    the first section is the file's description and is not returned.

    Raises:
        ValueError: no section, or a name used twice.
    """
    parts = _SECTION.split(text)
    names = parts[1::2]
    if not names or len(set(names)) != len(names):
        raise ValueError(f"kernel file sections {names}: expected at least one, names unique")
    return dict(zip(names, parts[2::2], strict=True))


def render(text: str, keep: Iterable[str] = (), **values: str) -> str:
    """``text`` with each placeholder ``@NAME@`` replaced by ``values[NAME]`` (in one pass:
    placeholders inside the values are not replaced). A placeholder alone on its line takes
    the line's end with it: its value is whole lines (empty, or ending in a newline).

    Args:
        keep: placeholders left as they are, for a later :func:`render` (in ``text`` or
            brought in by a value).

    Raises:
        ValueError: a placeholder of ``text`` with no value and not kept, a value no
            placeholder uses, a line placeholder's value that does not end its line, or a
            placeholder left in the result that is not kept.
    """
    keep = set(keep)
    found = set(_PLACEHOLDER.findall(text))
    missing, unused = found - values.keys() - keep, values.keys() - found
    if missing or unused:
        raise ValueError(f"kernel text placeholders without a value: {sorted(missing)}; "
                         f"values for no placeholder: {sorted(unused)}")

    def value(match: re.Match) -> str:
        line, inline = match.groups()
        name = line or inline
        if name not in values:
            return match.group(0)
        if line and values[name] and not values[name].endswith("\n"):
            raise ValueError(f"@{name}@ stands alone on its line: its value must end in a "
                             "newline")
        return values[name]

    out = _PLACEHOLDER_USE.sub(value, text)
    left = set(_PLACEHOLDER.findall(out)) - keep
    if left:
        raise ValueError(f"kernel text placeholders left unfilled: {sorted(left)}")
    return out


def _check_filled(text: str, what: str) -> None:
    left = sorted(set(_PLACEHOLDER.findall(text)))
    if left:
        raise ValueError(f"kernel {what} has unfilled placeholders {left} (see render)")


def _check_dialect(dialect: str) -> None:
    if dialect not in DIALECTS:
        raise ValueError(f"unknown GPU dialect {dialect!r} (expected one of {DIALECTS})")


def dialect_header(dialect: Dialect) -> str:
    """The dialect's header: the ``UNI_*`` macros and ``uni_*`` functions.

    Raises:
        ValueError: unknown dialect.
    """
    _check_dialect(dialect)
    return kernel_file(__package__, f"gpu_dialect_{dialect}.h")


def body_prefix(dialect: Dialect, source: str) -> str:
    """The declarations of the ``uni_*`` indices that ``source`` mentions, one per line.

    Raises:
        ValueError: unknown dialect.
    """
    _check_dialect(dialect)
    col = 1 if dialect == "metal" else 2
    lines = [row[col] for row in _INDICES if re.search(rf"\b{row[0]}\b", source)]
    return "".join(f"    {line}\n" for line in lines)


def instance_source(source: str, *, dialect: Dialect, header: str = "") -> tuple[str, str]:
    """``(header, source)`` handed to MLX for the dialect's instance of a kernel body.

    The header is the dialect header followed by the kernel's own ``header``; the source is
    the body prefix followed by the body.

    Raises:
        ValueError: unknown dialect, or a placeholder (``@NAME@``, :func:`render`) left in
            ``source`` or ``header``.
    """
    _check_filled(source, "source")
    _check_filled(header, "header")
    return dialect_header(dialect) + header, body_prefix(dialect, source) + source


@functools.cache
def _kernel(name: str, input_names: tuple[str, ...], output_names: tuple[str, ...],
            source: str, dialect: Dialect, header: str):
    full_header, full_source = instance_source(source, dialect=dialect, header=header)
    make = mx.fast.metal_kernel if dialect == "metal" else mx.fast.cuda_kernel
    return make(name=name, input_names=list(input_names), output_names=list(output_names),
                source=full_source, header=full_header)


def kernel(name: str, input_names: Sequence[str], output_names: Sequence[str], source: str,
           *, dialect: Dialect, header: str = ""):
    """The MLX kernel callable of a one-source body for ``dialect`` (cached per arguments).

    Args:
        name: kernel name (MLX derives the function name from it).
        input_names, output_names: parameter names, in call order.
        source: the body, written with the names of this module's table.
        dialect: ``"cuda"`` (``mx.fast.cuda_kernel``) or ``"metal"`` (``mx.fast.metal_kernel``).
        header: the kernel's own header (helpers), placed after the dialect header.

    Returns:
        What ``mx.fast.cuda_kernel`` / ``mx.fast.metal_kernel`` return; call it with MLX's
        usual ``inputs=, template=, grid=, threadgroup=, output_shapes=, output_dtypes=``.

    Raises:
        ValueError: unknown dialect, or a placeholder left in ``source`` or ``header``.
        RuntimeError: MLX's own, when this MLX build has no backend of that dialect (CUDA:
            here; Metal: when the kernel is called).
    """
    _check_dialect(dialect)
    return _kernel(name, tuple(input_names), tuple(output_names), source, dialect, header)


# --- MLX 0.32.4's Metal assembly, reproduced (mlx/backend/common/metal_kernel.cpp) ---

_METAL_TYPES = {
    mx.float32: "float", mx.float16: "float16_t", mx.bfloat16: "bfloat16_t",
    mx.float64: "double", mx.complex64: "complex64_t", mx.bool_: "bool",
    mx.int8: "int8_t", mx.int16: "int16_t", mx.int32: "int32_t", mx.int64: "int64_t",
    mx.uint8: "uint8_t", mx.uint16: "uint16_t", mx.uint32: "uint32_t", mx.uint64: "uint64_t",
}

#: metal_kernel's table of thread attributes: (attribute, parameter type), in MLX's order
METAL_ATTRIBUTES = (
    ("dispatch_quadgroups_per_threadgroup", "uint"),
    ("dispatch_simdgroups_per_threadgroup", "uint"),
    ("dispatch_threads_per_threadgroup", "uint3"),
    ("grid_origin", "uint3"),
    ("grid_size", "uint3"),
    ("quadgroup_index_in_threadgroup", "uint"),
    ("quadgroups_per_threadgroup", "uint"),
    ("simdgroup_index_in_threadgroup", "uint"),
    ("simdgroups_per_threadgroup", "uint"),
    ("thread_execution_width", "uint"),
    ("thread_index_in_quadgroup", "uint"),
    ("thread_index_in_simdgroup", "uint"),
    ("thread_index_in_threadgroup", "uint"),
    ("thread_position_in_grid", "uint3"),
    ("thread_position_in_threadgroup", "uint3"),
    ("threadgroup_position_in_grid", "uint3"),
    ("threadgroups_per_grid", "uint3"),
    ("threads_per_grid", "uint3"),
    ("threads_per_simdgroup", "uint"),
    ("threads_per_threadgroup", "uint3"),
)

_MAX_CONSTANT_ARRAY_SIZE = 8  # inputs with fewer elements go in the constant address space


def _type_string(dtype: mx.Dtype) -> str:
    try:
        return _METAL_TYPES[dtype]
    except KeyError:
        raise ValueError(f"Unsupported compilation type {dtype}") from None


def _template_value(arg: int | bool | mx.Dtype) -> str:
    if isinstance(arg, bool):
        return "1" if arg else "0"  # std::ostream << bool
    if isinstance(arg, int):
        return str(arg)
    return _type_string(arg)


def _template_param(arg: int | bool | mx.Dtype) -> str:
    return "bool" if isinstance(arg, bool) else "int" if isinstance(arg, int) else "typename"


def mlx_metal_source(name: str, input_names: Sequence[str], output_names: Sequence[str],
                     source: str, inputs: Sequence[mx.array],
                     template: Sequence[tuple[str, int | bool | mx.Dtype]] = (), *,
                     output_dtypes: Sequence[mx.Dtype], header: str = "",
                     atomic_outputs: bool = False) -> tuple[str, str]:
    """``(function name, source)`` that ``mx.fast.metal_kernel(name, input_names,
    output_names, source, header, atomic_outputs=...)`` builds when called with ``inputs``,
    ``template`` and ``output_dtypes`` (MLX 0.32.4; no dialect added). The source is what MLX
    appends to its Metal utilities (``metal_stdlib``, ``using namespace metal``,
    ``float16_t``/``bfloat16_t``) before compiling.

    ``inputs``: anything with MLX's ``shape``, ``dtype`` (an ``mx.Dtype``) and ``size``.

    MLX's quirks are kept: a parameter is added when its name occurs anywhere in the body
    text (comments included), and with ``_shape``/``_strides``/``_ndim`` buffers, several
    outputs and no attribute parameter, the signature is closed early (invalid source; a
    dialect body that uses any ``uni_*`` index always has an attribute).

    Raises:
        ValueError: no outputs, mismatched counts, or a dtype MLX cannot compile.
    """
    if not output_names:
        raise ValueError("[metal_kernel] Must specify at least one output.")
    if len(inputs) != len(input_names):
        raise ValueError(f"[metal_kernel] Expected `inputs` to have size {len(input_names)} "
                         f"but got size {len(inputs)}.")
    if len(output_dtypes) != len(output_names):
        raise ValueError(f"[metal_kernel] Expected `output_dtypes` to have size "
                         f"{len(output_names)} but got size {len(output_dtypes)}.")
    attributes = [f"  {t} {a} [[{a}]]" for a, t in METAL_ATTRIBUTES if a in source]

    func = "custom_kernel_" + name
    template_def = ""
    if template:
        template_def = "<" + ", ".join(_template_value(a) for _, a in template) + ">"
        func += "_" + template_def.replace("<", "_").replace(">", "_").replace(", ", "_")[:-1]
    for arr in inputs:
        func += "_" + _type_string(arr.dtype)
        if len(arr.shape) == 0:
            func += "s"
        elif arr.size < _MAX_CONSTANT_ARRAY_SIZE:
            func += "c"
    for dtype in output_dtypes:
        func += "_" + _type_string(dtype)

    out = [header]
    if template:
        out.append("template <" + ", ".join(f"{_template_param(a)} {n}" for n, a in template)
                   + ">\n")
    out.append(f"[[kernel]] void {func}(\n")
    index = 0
    for arr_name, arr in zip(input_names, inputs, strict=True):
        location = "constant" if arr.size < _MAX_CONSTANT_ARRAY_SIZE else "device"
        ref = "&" if len(arr.shape) == 0 else "*"
        out.append(f"  const {location} {_type_string(arr.dtype)}{ref} {arr_name} "
                   f"[[buffer({index})]],\n")
        index += 1
        if len(arr.shape) > 0:
            for suffix, decl in (("_shape", "const constant int*"),
                                 ("_strides", "const constant int64_t*"),
                                 ("_ndim", "const constant int&")):
                if arr_name + suffix in source:
                    out.append(f"  {decl} {arr_name}{suffix} [[buffer({index})]],\n")
                    index += 1
    for arr_name, dtype in zip(output_names, output_dtypes, strict=True):
        type_string = _type_string(dtype)
        if atomic_outputs:
            type_string = f"atomic<{type_string}>"
        out.append(f"  device {type_string}* {arr_name} [[buffer({index})]]")
        # MLX compares the running buffer index (shape/stride buffers included) with
        # len(inputs) + len(outputs) - 1; reproduced as is.
        last = index >= len(inputs) + len(output_names) - 1 and not attributes
        out.append(") {\n" if last else ",\n")
        index += 1
    out.append(",\n".join(attributes))
    if attributes:
        out.append(") {\n")
    out.append(source)
    out.append("\n}\n")
    if template:
        inst = func + template_def
        out.append(f'\ntemplate [[host_name("{func}")]] [[kernel]] decltype({inst}) {inst};\n')
    return func, "".join(out)


def assemble_metal(name: str, input_names: Sequence[str], output_names: Sequence[str],
                   source: str, inputs: Sequence[mx.array],
                   template: Sequence[tuple[str, int | bool | mx.Dtype]] = (), *,
                   output_dtypes: Sequence[mx.Dtype], header: str = "") -> tuple[str, str]:
    """``(function name, source)`` of the Metal instance of a one-source body, exactly as
    ``kernel(name, input_names, output_names, source, dialect="metal", header=header)``
    makes MLX 0.32.4 build it when called with ``inputs``/``template``/``output_dtypes``
    (see :func:`mlx_metal_source`).

    Raises:
        ValueError: as :func:`mlx_metal_source`.
    """
    full_header, full_source = instance_source(source, dialect="metal", header=header)
    return mlx_metal_source(name, input_names, output_names, full_source, inputs, template,
                            output_dtypes=output_dtypes, header=full_header)
