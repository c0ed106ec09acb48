"""The disk tier: vLLM's fs secondary tier with private files, checksums and layout keys.

vLLM 0.32's ``FileSystemTierManager`` writes one file per offloaded chunk (``os.write`` of the
host pool's bytes to a temp file, then ``os.replace``) and reads it back with ``os.readv``
into the host pool; only a short read is detected. Its files are created ``0644`` and its
directories with the process umask, nothing checks the bytes on load, and its directory key
(model name, dtype, tokens per hash, blocks per file, layer names) leaves the block geometry
out. :class:`VerifiedFileSystemTier` keeps vLLM's tier (lookups, thread pool, job accounting,
file naming) and replaces the file I/O:

* every directory this tier creates is ``0700``, every file ``0600``; nothing is opened through
  a symbolic link, and only directories and files of this user that group and others cannot
  write are used (:mod:`vllm_unified.offload.private_dir`: the tier directory is held open and
  every path below it walked with ``O_NOFOLLOW``); a link, another user's file or one others
  may write is removed and counted as ``unsafe``;
* files live under ``ROOT/vllm-unified-<layout>/`` where ``<layout>`` hashes the offload
  layout (dtype, tokens per block and per hash, blocks per chunk, bytes per block and chunk,
  KV layout, layers, heads and head size, model, and the identity of the checkpoint's files,
  :mod:`vllm_unified.offload.weights_identity`), so layouts and models never share files;
* each file is a one-page header (magic, format version, layout digest, the block's key,
  payload size, CRC-32 of the payload, CRC-32 of the header) followed by the chunk's bytes.
  A store writes header and payload with one ``writev`` straight from the host pool; a load
  reads them with one ``readv`` straight into the host pool slot being promoted, then checks
  size, header, key, layout and checksum. A truncated, corrupt, foreign or unsafe file is
  removed and reported as a failed load: vLLM's tiering manager then releases that slot
  without making it readable and the prefix is recomputed. Each one is counted in
  ``vllm:kv_offload_fs_invalid_blocks{reason=...}``.
* at shutdown, queued stores are finished for up to :data:`SHUTDOWN_DRAIN_S` seconds and the
  rest dropped before they start; a file gets its final name only once complete.

The header is a full page so that ``O_DIRECT`` (used where the file system supports it, as
vLLM does) keeps its alignment.
"""

from __future__ import annotations

import contextlib
import errno
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
from vllm_unified.offload.private_dir import PrivateDir, UnsafePath, unsafe_reason
from vllm_unified.offload.weights_identity import weights_identity

logger = init_logger(__name__)

INVALID_BLOCKS = "vllm:kv_offload_fs_invalid_blocks"
#: ``unsafe``: a symbolic link, not a regular file, another user's, writable by group/others,
#: or below such a directory.
REASONS = ("truncated", "corrupt", "foreign", "unsafe")

FORMAT_VERSION = 1
MAGIC = b"VUKVBLK\x00"
HEADER_SIZE = mmap.PAGESIZE
MAX_KEY = 256
# magic, version, header size, layout digest, payload bytes, payload crc32, key length, key
_FIELDS = struct.Struct(f"<8sII32sQII{MAX_KEY}s")
_HEADER_CRC = struct.Struct("<I")
_O_DIRECT = getattr(os, "O_DIRECT", 0)
_O_NOFOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC
#: Seconds :meth:`VerifiedFileSystemTier.shutdown` waits for queued stores before dropping
#: the rest (below the engine core's teardown window, vllm_unified.platform).
SHUTDOWN_DRAIN_S = 5.0
#: A temporary block file (``*.tmp``) not modified for this long when a tier starts was left by
#: a process killed mid-write (a write takes milliseconds): the tier removes it. Younger ones
#: may belong to another server writing to the same directory and are kept.
STALE_TMP_S = 600.0
_local = threading.local()


class InvalidBlockFile(OSError):
    """A block file that must not be loaded; ``reason`` is one of :data:`REASONS`."""

    def __init__(self, path: str, reason: str, detail: str) -> None:
        super().__init__(f"{path}: {reason} KV block file ({detail})")
        self.reason = reason


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


def _keep_existing(dir_fd: int, name: str) -> bool:
    """True if ``name`` in ``dir_fd`` is already a safe file of this user (keep it); a link,
    FIFO or another user's file there is removed first (False: write a new one)."""
    st = _lstat(dir_fd, name)
    if st is None:
        return False
    if unsafe_reason(st, kind="file") is None:
        return True
    os.unlink(name, dir_fd=dir_fd)
    return False


def store_block(tier: PrivateDir, path: str, payload: memoryview, layout: bytes, key: bytes,
                o_direct: bool = False) -> None:
    """Write ``payload`` (a slice of the host pool) to ``path`` (below ``tier``) with its
    header: a 0600 temp file in the same directory, one ``writev``, then an atomic rename.
    Missing directories are created (0700). An existing file of this user is kept; a link or
    another user's file in its place is replaced.

    Raises:
        UnsafePath: a directory on the way is a link, another user's or writable by others.
        OSError: the write failed or was short (no space, read-only file system: the temp
            file is removed, nothing is left behind).
    """
    subdir, name = tier.relative(path)
    with tier.opened(subdir, create=True) as dir_fd:
        if _keep_existing(dir_fd, name):
            return
        page = _page()
        _fill_header(page, layout, key, payload)
        tmp = name + _tmp_suffix()
        flags = (os.O_CREAT | os.O_EXCL | os.O_WRONLY | _O_NOFOLLOW
                 | (_O_DIRECT if o_direct else 0))
        try:
            fd = os.open(tmp, flags, 0o600, dir_fd=dir_fd)
            try:
                written = os.writev(fd, [page, payload])
            finally:
                os.close(fd)
            if written != HEADER_SIZE + payload.nbytes:
                raise OSError(errno.ENOSPC, f"short write to {tmp}: {written} of "
                                            f"{HEADER_SIZE + payload.nbytes} bytes")
            os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp, dir_fd=dir_fd)
            raise


def remove_stale_temp_files(tier: PrivateDir, older_than_s: float = STALE_TMP_S) -> int:
    """Remove the temporary block files below ``tier`` (``*.tmp``, regular files of this
    user) last modified more than ``older_than_s`` seconds ago; links are neither followed
    nor removed. Returns how many were removed.

    Raises:
        OSError: the directory cannot be read.
    """
    removed = 0
    cutoff = time.time() - older_than_s
    for _, _, names, dir_fd in os.fwalk(".", dir_fd=tier.fd, follow_symlinks=False):
        for name in names:
            if not name.endswith(".tmp"):
                continue
            st = _lstat(dir_fd, name)
            if st is None or unsafe_reason(st, kind="file") or st.st_mtime > cutoff:
                continue
            with contextlib.suppress(FileNotFoundError):  # another server's sweep
                os.unlink(name, dir_fd=dir_fd)
                removed += 1
    return removed


def load_block(tier: PrivateDir, path: str, dest: memoryview, layout: bytes, key: bytes,
               o_direct: bool = False) -> None:
    """Read ``path`` (below ``tier``) into ``dest`` (the host pool slot) with one ``readv``
    and verify it. ``dest`` holds garbage after a failure: the caller must not make it
    readable.

    Raises:
        InvalidBlockFile: the file is truncated (or too long), corrupt (header or payload
            checksum), foreign (another format, layout or key) or unsafe (a link, not a
            regular file, another user's, writable by group/others, or below such a
            directory); the file (not a directory) has been removed.
        OSError: the file could not be opened or read.
    """
    subdir, name = tier.relative(path)
    try:
        with tier.opened(subdir) as dir_fd:
            _load_at(dir_fd, name, path, dest, layout, key, o_direct)
    except UnsafePath as exc:  # a directory on the way: left in place, never read through
        raise InvalidBlockFile(path, "unsafe", str(exc)) from None


def _load_at(dir_fd: int, name: str, path: str, dest: memoryview, layout: bytes, key: bytes,
             o_direct: bool) -> None:
    # O_NONBLOCK: a FIFO put in a file's place must not block the reading thread.
    flags = os.O_RDONLY | os.O_NONBLOCK | _O_NOFOLLOW | (_O_DIRECT if o_direct else 0)
    try:
        fd = os.open(name, flags, dir_fd=dir_fd)
    except OSError:
        # ELOOP for a link; EINVAL (O_DIRECT) or ENXIO for a FIFO, socket or device
        st = _lstat(dir_fd, name)
        reason = st and unsafe_reason(st, kind="file")
        if reason:
            _reject(dir_fd, name, path, "unsafe", reason)
        raise
    try:
        st = os.fstat(fd)
        reason = unsafe_reason(st, kind="file")
        if reason:
            _reject(dir_fd, name, path, "unsafe", reason)
        expected = HEADER_SIZE + dest.nbytes
        if st.st_size != expected:
            _reject(dir_fd, name, path, "truncated", f"{st.st_size} bytes, expected {expected}")
        page = _page()
        got = os.readv(fd, [page, dest])
    finally:
        os.close(fd)
    if got != expected:
        _reject(dir_fd, name, path, "truncated", f"read {got} of {expected} bytes")
    fields = page[:_FIELDS.size]
    (stored_crc,) = _HEADER_CRC.unpack(page[_FIELDS.size:_FIELDS.size + 4])
    if zlib.crc32(fields) != stored_crc:
        _reject(dir_fd, name, path, "corrupt", "header checksum mismatch")
    magic, version, header_size, file_layout, nbytes, crc, key_len, file_key = (
        _FIELDS.unpack(fields))
    if magic != MAGIC or version != FORMAT_VERSION or header_size != HEADER_SIZE:
        _reject(dir_fd, name, path, "foreign", f"format {magic!r} v{version}")
    if file_layout != layout or nbytes != dest.nbytes:
        _reject(dir_fd, name, path, "foreign", "another KV layout")
    if file_key[:key_len] != key:
        _reject(dir_fd, name, path, "foreign", "another block's key")
    if zlib.crc32(dest) != crc:
        _reject(dir_fd, name, path, "corrupt", "payload checksum mismatch")


def _lstat(dir_fd: int, name: str) -> os.stat_result | None:
    try:
        return os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return None


def _reject(dir_fd: int, name: str, path: str, reason: str, detail: str) -> None:
    try:
        os.unlink(name, dir_fd=dir_fd)
    except FileNotFoundError:
        pass
    except OSError as exc:  # e.g. a directory in the file's place: still never loaded
        logger.warning("vllm-unified: cannot remove rejected KV block file %s: %s", path, exc)
    raise InvalidBlockFile(path, reason, detail)


def layout_fields(spec: Any) -> dict[str, Any]:
    """What fixes the bytes of an offloaded chunk (and so which files may be shared): the
    geometry, and the checkpoint whose weights computed them
    (:func:`~vllm_unified.offload.weights_identity.weights_identity`)."""
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
        "weights": weights_identity(config.model.name,
                                    spec.extra_config.get("model_revision")),
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
        UnsafePath: ``root_dir``, an ancestor or the tier directory may be written by another
            user, or is a link (:mod:`vllm_unified.offload.private_dir`).
    """

    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict[str, Any]:
        return {INVALID_BLOCKS: compat.OffloadingCounterMetadata(
            documentation="KV block files found truncated, corrupt, of a foreign layout or "
                          "unsafe (a link, another user's) on load (removed, counted as a miss "
                          "and recomputed).",
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
        self._dir = PrivateDir(root_dir, f"vllm-unified-{self._layout.hex()[:16]}")
        try:
            _write_private_config(self._dir, offloading_spec)
            stale = remove_stale_temp_files(self._dir)
            if stale:
                logger.info("vllm-unified: KV offload disk tier: removed %d temporary block "
                            "file(s) left by a process killed mid-write", stale)
            super().__init__(offloading_spec, primary_kv_view, tier_type, self._dir.path,
                             **kwargs)
        except BaseException:
            self._dir.close()
            raise
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
            store_block(self._dir, path, view, self._layout, bytes(key), self._use_o_direct)

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
                load_block(self._dir, path, view, self._layout, bytes(key), self._use_o_direct)
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
        self._dir.close()
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


def _write_private_config(tier: PrivateDir, spec) -> None:
    """vLLM's fs tier writes ``config.json`` with default modes when it is missing, following
    links: create its directory (0700) and the file (0600) first, with the same content, and
    replace a link or another user's file found there.

    Raises:
        UnsafePath: the config directory is a link, another user's or writable by others.
    """
    mapper = compat.FileMapper.from_offloading_spec(
        root_dir=tier.path, offloading_spec=spec, blocks_per_file=spec.blocks_per_chunk,
        parallel_agnostic=True,
    )
    subdir, name = tier.relative(mapper.get_config_file_path())
    with tier.opened(subdir, create=True) as dir_fd:
        if _keep_existing(dir_fd, name):
            return
        fd = os.open(name, os.O_CREAT | os.O_EXCL | os.O_WRONLY | _O_NOFOLLOW, 0o600,
                     dir_fd=dir_fd)
        with os.fdopen(fd, "w") as f:
            json.dump(mapper.get_run_config(), f, indent=2, sort_keys=True)
