"""Where this process's resident memory is: ``/proc/self/smaps`` by kind of mapping.

``psutil``'s RSS is one number; the engine's start-up memory mixes MLX's weights and buffer
cache, torch, the Python heap, glibc's free lists, the shared libraries' code and any file the
process still maps. :func:`smaps_breakdown` splits it by mapping kind (Linux only; None
elsewhere):

* ``anon``: anonymous private memory (malloc's heap and arenas, MLX and torch buffers, Python
  objects): ``Anonymous`` summed over all mappings;
* ``file``: file-backed resident pages (``Rss - Anonymous``): shared libraries' code and data,
  and data files mapped by the process (a GGUF file's memory map while it is open);
* ``libraries``: the file-backed part that belongs to code (``*.so*`` files and any file mapped
  executable, e.g. the interpreter);
* ``data_files``: the file-backed part of any other file (``largest_files`` names the biggest);
* ``uss``: the pages only this process maps (``Private_Clean + Private_Dirty``), and ``pss``:
  each page divided by the number of processes that map it. A forked process (vLLM's engine
  core, unless it is spawned) maps its parent's heap copy-on-write: those pages count in its
  RSS but not its USS until one side writes them.
"""

from __future__ import annotations

import ctypes
import sys
from pathlib import Path
from types import ModuleType

_KIB = 1024


def malloc_trim() -> bool:
    """Give glibc's free heap memory back to the OS (``malloc_trim(0)``: free pages anywhere in
    the heap and arenas, not only at the top). True if it released memory; False where there is
    no glibc (not Linux) or nothing was released."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except AttributeError:  # a libc without it (musl)
        return False
    return bool(trim(0))


def release_free_memory(mx: ModuleType) -> None:
    """Return start-up's freed memory to the OS: MLX's buffer cache (on MLX's CPU backend its
    buffers are malloc'ed, so emptying the cache hands them to glibc, which keeps them) and then
    glibc's free lists. What a later step needs is allocated again; nothing live is touched.

    Called by the worker after the weights load (the GGUF reader's numpy temporaries and MLX
    arrays it freed) and after the warm-up forward, so the engine's resident memory after
    start-up is the memory it holds, not the scratch of getting there."""
    mx.clear_cache()
    malloc_trim()


def smaps_breakdown(pid: int | str = "self", top: int = 5) -> dict | None:
    """Resident bytes of process ``pid`` by mapping kind (see the module docstring), or None
    where ``/proc/<pid>/smaps`` does not exist (not Linux)."""
    path = Path(f"/proc/{pid}/smaps")
    if not sys.platform.startswith("linux") or not path.exists():
        return None
    rss = anon = pss = private = 0
    files: dict[str, int] = {}  # file-backed resident bytes per mapped file
    code: set[str] = set()  # files mapped executable somewhere (libraries, the interpreter)
    name, mapping_rss = "", 0
    with open(path) as f:
        for line in f:
            head = line.split(maxsplit=1)[0]
            if not head.endswith(":"):  # a mapping: "start-end perms offset dev inode [path]"
                parts = line.split(maxsplit=5)
                name = parts[5].strip() if len(parts) > 5 else ""
                if name.startswith("/") and "x" in parts[1]:
                    code.add(name)
            elif head == "Rss:":
                mapping_rss = int(line.split()[1]) * _KIB
                rss += mapping_rss
            elif head == "Pss:":
                pss += int(line.split()[1]) * _KIB
            elif head in ("Private_Clean:", "Private_Dirty:"):
                private += int(line.split()[1]) * _KIB
            elif head == "Anonymous:":
                mapping_anon = int(line.split()[1]) * _KIB
                anon += mapping_anon
                if name.startswith("/") and mapping_rss > mapping_anon:
                    files[name] = files.get(name, 0) + mapping_rss - mapping_anon
    libraries = sum(v for k, v in files.items() if k in code or ".so" in Path(k).name)
    data = {k: v for k, v in files.items() if not (k in code or ".so" in Path(k).name)}
    largest = sorted(data.items(), key=lambda kv: -kv[1])[:top]
    return {"rss": rss, "pss": pss, "uss": private, "anon": anon, "file": rss - anon,
            "libraries": libraries,
            "data_files": sum(data.values()), "largest_files": dict(largest)}
