"""The disk tier: vLLM's fs secondary tier with private files, checksums and layout keys.

vLLM 0.32's ``FileSystemTierManager`` writes one file per offloaded chunk (``os.write`` of the
host pool's bytes to a temp file, then ``os.replace``) and reads it back with ``os.readv``
into the host pool; only a short read is detected. Its files are created ``0644`` and its
directories with the process umask, nothing checks the bytes on load, and its directory key
(model name, dtype, tokens per hash, blocks per file, layer names) leaves the block geometry
out. :class:`VerifiedFileSystemTier` keeps vLLM's tier (lookups, thread pool, job accounting,
file naming) and replaces the file I/O:

* every directory this tier creates is ``0700``, every file ``0600``;
* files live under ``ROOT/vllm-unified-<layout>/`` where ``<layout>`` hashes the offload
  layout (dtype, tokens per block and per hash, blocks per chunk, bytes per block and chunk,
  KV layout, layers, heads and head size, model), so layouts never share files;
* each file is a one-page header (magic, format version, layout digest, the block's key,
  payload size, CRC-32 of the payload, CRC-32 of the header) followed by the chunk's bytes.
  A store writes header and payload with one ``writev`` straight from the host pool; a load
  reads them with one ``readv`` straight into the host pool slot being promoted, then checks
  size, header, key, layout and checksum. A truncated, corrupt or foreign file is removed and
  reported as a failed load: vLLM's tiering manager then releases that slot without making it
  readable and the prefix is recomputed. Each one is counted in
  ``vllm:kv_offload_fs_invalid_blocks{reason=...}``.
* at shutdown, queued stores are finished for up to :data:`SHUTDOWN_DRAIN_S` seconds and the
  rest dropped before they start; a file gets its final name only once complete.

The header is a full page so that ``O_DIRECT`` (used where the file system supports it, as
vLLM does) keeps its alignment.
"""

from __future__ import annotations

import functools
import hashlib
import json
import mmap
import os
import random
import struct
import threading
import time
import zlib
from typing import Any

from vllm_unified import compat
from vllm_unified.compat import init_logger
from vllm_unified.offload.host_views import check_buffer_address

logger = init_logger(__name__)

INVALID_BLOCKS = "vllm:kv_offload_fs_invalid_blocks"
REASONS = ("truncated", "corrupt", "foreign")

FORMAT_VERSION = 1
MAGIC = b"VUKVBLK\x00"
HEADER_SIZE = mmap.PAGESIZE
MAX_KEY = 256
# magic, version, header size, layout digest, payload bytes, payload crc32, key length, key
_FIELDS = struct.Struct(f"<8sII32sQII{MAX_KEY}s")
_HEADER_CRC = struct.Struct("<I")
_O_DIRECT = getattr(os, "O_DIRECT", 0)
#: Seconds :meth:`VerifiedFileSystemTier.shutdown` waits for queued stores before dropping
#: the rest (below the engine core's teardown window, vllm_unified.platform).
SHUTDOWN_DRAIN_S = 5.0
_local = threading.local()


class InvalidBlockFile(OSError):
    """A block file that must not be loaded; ``reason`` is one of :data:`REASONS`."""

    def __init__(self, path: str, reason: str, detail: str) -> None:
        super().__init__(f"{path}: {reason} KV block file ({detail})")
        self.reason = reason


def make_private_dirs(path: str) -> None:
    """Create ``path`` and its missing parents with mode 0700 (existing ones are left as
    they are)."""
    missing = []
    while path and not os.path.isdir(path):
        missing.append(path)
        path = os.path.dirname(path)
    for d in reversed(missing):
        try:
            os.mkdir(d, 0o700)
        except FileExistsError:
            if not os.path.isdir(d):
                raise


def _page() -> mmap.mmap:
    """This thread's page-aligned header buffer (aligned for ``O_DIRECT``)."""
    page = getattr(_local, "page", None)
    if page is None:
        page = _local.page = mmap.mmap(-1, HEADER_SIZE)
    return page


def _tmp_suffix() -> str:
    suffix = getattr(_local, "suffix", None)
    if suffix is None:
        suffix = _local.suffix = f".{random.getrandbits(63):x}.tmp"
    return suffix


def _fill_header(page: mmap.mmap, layout: bytes, key: bytes, payload: memoryview) -> None:
    if len(key) > MAX_KEY:
        raise ValueError(f"offload key of {len(key)} bytes exceeds {MAX_KEY}")
    page[:] = bytes(HEADER_SIZE)
    fields = _FIELDS.pack(MAGIC, FORMAT_VERSION, HEADER_SIZE, layout, payload.nbytes,
                          zlib.crc32(payload), len(key), key)
    page[:_FIELDS.size] = fields
    page[_FIELDS.size:_FIELDS.size + 4] = _HEADER_CRC.pack(zlib.crc32(fields))


def store_block(path: str, payload: memoryview, layout: bytes, key: bytes,
                o_direct: bool = False) -> None:
    """Write ``payload`` (a slice of the host pool) to ``path`` with its header: a 0600 temp
    file, one ``writev``, then an atomic rename. An existing file is kept.

    Raises:
        OSError: the write failed or was short (the temp file is removed).
    """
    if os.path.exists(path):
        return
    make_private_dirs(os.path.dirname(path))
    page = _page()
    _fill_header(page, layout, key, payload)
    tmp = path + _tmp_suffix()
    flags = os.O_CREAT | os.O_EXCL | os.O_WRONLY | (_O_DIRECT if o_direct else 0)
    try:
        fd = os.open(tmp, flags, 0o600)
        try:
            written = os.writev(fd, [page, payload])
        finally:
            os.close(fd)
        if written != HEADER_SIZE + payload.nbytes:
            raise OSError(f"short write to {tmp}: {written} of {HEADER_SIZE + payload.nbytes}")
        os.replace(tmp, path)
    except BaseException:
        try:
            os.remove(tmp)
        except FileNotFoundError:
            pass
        raise


def load_block(path: str, dest: memoryview, layout: bytes, key: bytes,
               o_direct: bool = False) -> None:
    """Read ``path`` into ``dest`` (the host pool slot) with one ``readv`` and verify it.

    Raises:
        InvalidBlockFile: the file is truncated (or too long), corrupt (header or payload
            checksum) or foreign (another format, layout or key); it has been removed.
        OSError: the file could not be opened or read.
    """
    flags = os.O_RDONLY | (_O_DIRECT if o_direct else 0)
    fd = os.open(path, flags)
    try:
        size = os.fstat(fd).st_size
        expected = HEADER_SIZE + dest.nbytes
        if size != expected:
            _reject(path, "truncated", f"{size} bytes, expected {expected}")
        page = _page()
        got = os.readv(fd, [page, dest])
    finally:
        os.close(fd)
    if got != expected:
        _reject(path, "truncated", f"read {got} of {expected} bytes")
    fields = page[:_FIELDS.size]
    (stored_crc,) = _HEADER_CRC.unpack(page[_FIELDS.size:_FIELDS.size + 4])
    if zlib.crc32(fields) != stored_crc:
        _reject(path, "corrupt", "header checksum mismatch")
    magic, version, header_size, file_layout, nbytes, crc, key_len, file_key = (
        _FIELDS.unpack(fields))
    if magic != MAGIC or version != FORMAT_VERSION or header_size != HEADER_SIZE:
        _reject(path, "foreign", f"format {magic!r} v{version}")
    if file_layout != layout or nbytes != dest.nbytes:
        _reject(path, "foreign", "another KV layout")
    if file_key[:key_len] != key:
        _reject(path, "foreign", "another block's key")
    if zlib.crc32(dest) != crc:
        _reject(path, "corrupt", "payload checksum mismatch")


def _reject(path: str, reason: str, detail: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass
    raise InvalidBlockFile(path, reason, detail)


def layout_fields(spec: Any) -> dict[str, Any]:
    """What fixes the bytes of an offloaded chunk (and so which files may be shared)."""
    config = spec.config
    return {
        "format": FORMAT_VERSION,
        "model": config.model.name,
        "dtype": config.model.dtype,
        "tokens_per_hash": config.cache.tokens_per_hash,
        "blocks_per_chunk": config.cache.blocks_per_chunk,
        "groups": [[g.tokens_per_block, list(g.layer_names)] for g in config.groups],
        "bytes_per_block": config.worker_kv_bytes_per_block,
        "bytes_per_chunk": spec.kv_bytes_per_chunk,
        "kv_cache_layout": config.kv_cache_layout,
        "kv_geometry": spec.extra_config.get("kv_geometry"),
    }


def layout_digest(spec: Any) -> bytes:
    """SHA-256 of :func:`layout_fields` (32 bytes)."""
    text = json.dumps(layout_fields(spec), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).digest()


class VerifiedFileSystemTier(compat.FileSystemTierManager):
    """vLLM's fs tier with private modes, checksummed files and layout-keyed directories.

    Takes the fs tier's arguments (``root_dir``, thread counts, ...).

    Raises:
        RuntimeError: the primary view is not over vLLM's shared offload region (a copy
            would make the disk tier read and write bytes the host pool never sees).
    """

    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict[str, Any]:
        return {INVALID_BLOCKS: compat.OffloadingCounterMetadata(
            documentation="KV block files found truncated, corrupt or of a foreign layout "
                          "on load (removed, counted as a miss and recomputed).",
            labelnames=("reason",),
        )}

    def __init__(self, offloading_spec, primary_kv_view: memoryview, tier_type: str,
                 root_dir: str, **kwargs: Any) -> None:
        region = getattr(offloading_spec, "_scheduler_mmap", None)
        if region is None:
            raise RuntimeError("the disk tier needs vLLM's shared offload region")
        check_buffer_address(primary_kv_view, region.base_tensor.data_ptr(),
                             "disk tier's host pool view")
        self._layout = layout_digest(offloading_spec)
        root = os.path.join(os.path.abspath(root_dir), f"vllm-unified-{self._layout.hex()[:16]}")
        _write_private_config(root, offloading_spec)
        super().__init__(offloading_spec, primary_kv_view, tier_type, root, **kwargs)
        self._bytes = primary_kv_view.cast("B")
        self._invalid_lock = threading.Lock()
        self._invalid: dict[str, int] = {}
        self._reported: dict[str, int] = {}
        logger.info("vllm-unified: KV offload disk tier at %s (O_DIRECT %s)",
                    os.path.dirname(self.file_mapper.get_config_file_path()),
                    "on" if self._use_o_direct else "off")

    def _slices(self, chunk_ids) -> list[memoryview]:
        size = self._block_size
        out = []
        for cid in chunk_ids:
            off = int(cid) * size
            if off < 0 or off + size > self._bytes.nbytes:
                raise IndexError(f"host chunk {int(cid)} out of range")
            out.append(self._bytes[off:off + size])
        return out

    def submit_store(self, job_metadata) -> None:
        keys = list(job_metadata.keys)
        if self.events is not None:
            self._store_job_keys[job_metadata.job_id] = keys
        task = functools.partial(self._store, [self.file_mapper.get_file_name(k) for k in keys],
                                 keys, self._slices(job_metadata.chunk_ids))
        self._job_block_counts[job_metadata.job_id] = len(keys)
        self._pool.enqueue_store(job_metadata.job_id, 1, [task])

    def _store(self, paths: list[str], keys: list[bytes], views: list[memoryview]) -> None:
        for path, key, view in zip(paths, keys, views, strict=True):
            store_block(path, view, self._layout, bytes(key), self._use_o_direct)

    def submit_load(self, job_metadata) -> None:
        job_id = job_metadata.job_id
        keys = list(job_metadata.keys)
        self._load_job_keys[job_id] = keys
        self._job_block_counts[job_id] = len(keys)
        task = functools.partial(self._load, job_id,
                                 [self.file_mapper.get_file_name(k) for k in keys], keys,
                                 self._slices(job_metadata.chunk_ids))
        self._pool.enqueue_load(job_id, 1, [task])

    def _load(self, job_id: int, paths: list[str], keys: list[bytes],
              views: list[memoryview]) -> None:
        for i, (path, key, view) in enumerate(zip(paths, keys, views, strict=True)):
            try:
                load_block(path, view, self._layout, bytes(key), self._use_o_direct)
            except OSError as exc:
                # vLLM's fs tier keeps the blocks loaded before the failing one.
                self._load_progress[job_id] = i
                if isinstance(exc, InvalidBlockFile):
                    with self._invalid_lock:
                        self._invalid[exc.reason] = self._invalid.get(exc.reason, 0) + 1
                    logger.warning("vllm-unified: %s; treated as a miss", exc)
                raise

    def get_stats(self):
        with self._invalid_lock:
            new = {r: n - self._reported.get(r, 0) for r, n in self._invalid.items()
                   if n != self._reported.get(r, 0)}
            self._reported = dict(self._invalid)
        if not new:
            return None
        stats = compat.OffloadingConnectorStats()
        for reason, n in new.items():
            stats.increase_counter(INVALID_BLOCKS, n, (reason,))
        return stats

    def shutdown(self) -> None:
        """Finish the queued stores for up to :data:`SHUTDOWN_DRAIN_S` seconds, then drop
        the ones not started (vLLM's pool shutdown: queues cleared, each writer thread
        finishes the job it is on). A dropped block never had a file: a store writes a temp
        name and renames it into place only once complete, so nothing a later start would
        load is left half-written. The outcome is logged."""
        start = time.monotonic()
        drained = drain(self._pool, SHUTDOWN_DRAIN_S)
        super().shutdown()  # clears what is queued, joins the writers
        self._bytes.release()  # lets vLLM unmap the shared region
        if drained:
            logger.info("vllm-unified: KV offload disk tier shut down, queued writes finished "
                        "(%.2f s)", time.monotonic() - start)
        else:
            logger.warning("vllm-unified: KV offload disk tier shut down after %.0f s with "
                           "block writes still queued: those were dropped (no file written)",
                           SHUTDOWN_DRAIN_S)


def drain(pool: Any, seconds: float) -> bool:
    """Wait up to ``seconds`` for every job queued on vLLM's fs-tier thread pool
    (``DualQueueThreadPool``) to finish; True if they all did. Nothing is cancelled: the
    caller's ``pool.shutdown()`` drops what has not started (and releases the waiter)."""
    waiter = threading.Thread(target=pool.wait_idle, name="fs_tier_drain", daemon=True)
    waiter.start()
    waiter.join(seconds)
    return not waiter.is_alive()


def _write_private_config(root: str, spec) -> None:
    """vLLM's fs tier writes ``config.json`` with default modes when it is missing: create the
    directories (0700) and the file (0600) first, with the same content."""
    mapper = compat.FileMapper.from_offloading_spec(
        root_dir=root, offloading_spec=spec, blocks_per_file=spec.blocks_per_chunk,
        parallel_agnostic=True,
    )
    path = mapper.get_config_file_path()
    make_private_dirs(os.path.dirname(path))
    if os.path.exists(path):
        return
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(mapper.get_run_config(), f, indent=2, sort_keys=True)
