"""The disk tier under faults and hostile file systems, in process (no engine): vLLM's job API of
:class:`~vllm_unified.offload.disk.VerifiedFileSystemTier` over a real shared offload region.

Faults: the tier's file system full (a 1 MiB tmpfs) or read-only (the tmpfs remounted), a file
truncated, a symbolic link or FIFO in a file's place, a directory swapped for a link, files and
directories of another user. Security: no link is followed and nothing is written outside the
tier directory; a directory others can write is refused at start; a file of another model,
checkpoint or layout is never loaded. Each load that fails its check is a failed job (vLLM then
recomputes those tokens) and is counted by reason. Mounting and ``chown`` need root: as another
user these tests fail, naming why, rather than skip.
"""

from __future__ import annotations

import errno
import gc
import os
import re
import shutil
import stat
import time
import types
import uuid
from pathlib import Path

import numpy as np
import pytest
from conftest import remount, require_root, tmpfs
from vllm.v1.kv_offload.base import ReqContext
from vllm.v1.kv_offload.tiering.base import TransferJob

from vllm_unified import compat
from vllm_unified.offload import disk
from vllm_unified.offload.private_dir import PrivateDir, UnsafePath
from vllm_unified.offload.weights_identity import weights_identity

CHUNK = 2 * 4096  # bytes of one offloaded chunk (one KV block)
NUM_CHUNKS = 8
OTHER_UID = 65534  # "nobody"


def _spec(region, model: str = "m", dtype: str = "float16", heads: int = 2, revision=None):
    group = types.SimpleNamespace(tokens_per_block=16, layer_names=("l0", "l1"))
    parallel = types.SimpleNamespace(tp_size=1, pp_size=1, pcp_size=1, dcp_size=1, rank=0,
                                     is_parallelism_agnostic=True)
    config = types.SimpleNamespace(
        model=types.SimpleNamespace(name=model, dtype=dtype),
        cache=types.SimpleNamespace(tokens_per_hash=16, blocks_per_chunk=1),
        groups=[group], parallel=parallel, canonical_layout=False, replicated_layout=False,
        kv_cache_layout="LBNHC", worker_kv_bytes_per_block=CHUNK)
    return types.SimpleNamespace(
        config=config, blocks_per_chunk=1, kv_bytes_per_chunk=CHUNK, _scheduler_mmap=region,
        extra_config={"kv_geometry": {"num_kv_heads": heads, "head_size": 64},
                      "model_revision": revision},
        kv_events_config=None)


class Tier:
    """A VerifiedFileSystemTier at ``root`` over a fresh shared region, with helpers that
    run one store or load job to completion."""

    def __init__(self, root: Path, **spec) -> None:
        self.region = compat.SharedOffloadRegion(
            engine_id=f"test-{uuid.uuid4()}", num_chunks=NUM_CHUNKS, rank=0,
            kv_bytes_per_chunk=CHUNK, cpu_page_size=CHUNK)
        try:
            self.view = self.region.create_kv_memoryview()
            self.tier = disk.VerifiedFileSystemTier(
                _spec(self.region, **spec), self.view, "VerifiedFileSystemTier", str(root),
                n_read_threads=1, n_write_threads=1)
        except BaseException:
            self.region.cleanup()
            raise
        self.host = np.frombuffer(self.view, dtype=np.uint8).reshape(NUM_CHUNKS, CHUNK)
        self.next_job = 0

    def _run(self, keys, chunks, promotion: bool):
        self.next_job += 1
        job = TransferJob(job_id=self.next_job, keys=list(keys),
                          chunk_ids=np.array(chunks, dtype=np.int64), is_promotion=promotion,
                          req_context=ReqContext(req_id="r"))
        (self.tier.submit_load if promotion else self.tier.submit_store)(job)
        self.tier.drain_jobs()
        (result,) = list(self.tier.get_finished_jobs())
        assert result.job_id == self.next_job
        return result

    def store(self, keys, chunks):
        return self._run(keys, chunks, promotion=False)

    def load(self, keys, chunks):
        return self._run(keys, chunks, promotion=True)

    def path(self, key: bytes) -> Path:
        return Path(self.tier.file_mapper.get_file_name(key))

    def invalid(self) -> dict[str, float]:
        """Invalid block files by reason since the last call (the tier's stats delta)."""
        stats = self.tier.get_stats()
        if stats is None:
            return {}
        prefix = disk.INVALID_BLOCKS + ":"
        return {k[len(prefix):].strip("()',"): v for k, v in stats.reduce().items()
                if k.startswith(prefix)}

    def close(self) -> None:
        if self.tier is None:  # closed already
            return
        self.tier.shutdown()
        del self.host
        self.view.release()
        self.tier = None
        gc.collect()  # the tier's reference cycles hold the region's buffer
        self.region.cleanup()


def key(i: int) -> bytes:
    return bytes([i]) * 32 + (0).to_bytes(4, "big")


@pytest.fixture
def make_tier():
    made: list[Tier] = []

    def make(root: Path, **spec) -> Tier:
        made.append(Tier(root, **spec))
        return made[-1]

    yield make
    for t in made:
        t.close()


def _fill(tier: Tier, chunk: int, seed: int) -> np.ndarray:
    data = np.random.default_rng(seed).integers(0, 256, CHUNK, dtype=np.uint8)
    tier.host[chunk] = data
    return data


def _files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if not p.is_dir())


def _fill_disk(path: Path) -> None:
    """Write ``path`` until its file system has no space left."""
    fd = os.open(path, os.O_CREAT | os.O_WRONLY, 0o600)
    try:
        while True:
            os.write(fd, b"\0" * 4096)
    except OSError as exc:
        assert exc.errno == errno.ENOSPC, exc
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------------- round trip
def test_store_load_round_trip(tmp_path, make_tier):
    t = make_tier(tmp_path / "kv")
    want = _fill(t, 0, 1)
    assert t.store([key(1)], [0]).success
    t.host[3] = 0
    assert t.load([key(1)], [3]).success
    assert np.array_equal(t.host[3], want)
    assert stat.S_IMODE(t.path(key(1)).stat().st_mode) == 0o600


# ---------------------------------------------------------------------------------- faults
def test_disk_full_fails_the_store_and_leaves_nothing(tmp_path, make_tier):
    with tmpfs(tmp_path / "mnt", "1m") as mnt:
        t = make_tier(mnt / "kv")
        want = _fill(t, 0, 1)
        assert t.store([key(1)], [0]).success
        filler = mnt / "filler"
        _fill_disk(filler)
        before = _files(mnt)
        _fill(t, 1, 2)
        result = t.store([key(2)], [1])
        assert not result.success
        assert _files(mnt) == before  # no temp file, no partial file
        assert t.load([key(1)], [5]).success  # what was stored before still loads
        assert np.array_equal(t.host[5], want)
        filler.unlink()
        assert t.store([key(2)], [1]).success  # space back: stores work again


def test_read_only_file_system_fails_stores_serves_loads(tmp_path, make_tier):
    with tmpfs(tmp_path / "mnt", "4m") as mnt:
        t = make_tier(mnt / "kv")
        want = _fill(t, 0, 1)
        assert t.store([key(1)], [0]).success
        _fill(t, 1, 2)
        assert t.store([key(3)], [1]).success
        with open(t.path(key(3)), "r+b") as f:  # corrupt the payload of key 3
            f.seek(disk.HEADER_SIZE + 7)
            f.write(b"\xff\xfe")
        remount(mnt, "ro")
        try:
            before = _files(mnt)
            assert not t.store([key(2)], [1]).success
            assert t.load([key(1)], [4]).success
            assert np.array_equal(t.host[4], want)
            # a bad file cannot be removed on a read-only disk, but is still never loaded
            assert not t.load([key(3)], [5]).success
            assert t.invalid() == {"corrupt": 1}
            assert _files(mnt) == before
        finally:
            remount(mnt, "rw")


def test_truncated_file_fails_its_load_and_keeps_earlier_blocks(tmp_path, make_tier):
    t = make_tier(tmp_path / "kv")
    for i in range(3):
        _fill(t, i, i)
    assert t.store([key(1), key(2), key(3)], [0, 1, 2]).success
    os.truncate(t.path(key(2)), disk.HEADER_SIZE + 100)
    result = t.load([key(1), key(2), key(3)], [4, 5, 6])
    assert not result.success
    assert list(result.successful_keys) == [key(1)]  # vLLM keeps these, recomputes the rest
    assert not t.path(key(2)).exists()
    assert t.invalid() == {"truncated": 1}


def test_temporary_files_of_a_killed_writer_are_removed_at_the_next_start(tmp_path,
                                                                          make_tier):
    """A SIGKILL mid-write leaves ``NAME.<random>.tmp`` behind (never looked up: only complete
    files get their final name). The next tier at that directory removes such files once they
    are older than ``disk.STALE_TMP_S``; a younger one (another server's write in flight), a
    link and another user's file are left alone, and stored blocks still load."""
    t = make_tier(tmp_path / "kv")
    want = _fill(t, 0, 1)
    assert t.store([key(1)], [0]).success
    block = t.path(key(1))
    t.close()
    old = time.time() - disk.STALE_TMP_S - 5
    stale = [block.with_name(block.name + ".1f.tmp"), block.parent / "x" / "y.bin.2e.tmp"]
    stale[1].parent.mkdir(mode=0o700)
    young = block.with_name(block.name + ".3d.tmp")
    foreign = block.with_name(block.name + ".4c.tmp")
    link = block.with_name(block.name + ".5b.tmp")
    for path in (*stale, young, foreign):
        path.write_bytes(b"half a block")
        os.chmod(path, 0o600)
    os.chown(foreign, OTHER_UID, OTHER_UID)
    link.symlink_to(block)
    for path in (*stale, foreign, link):
        os.utime(path, (old, old), follow_symlinks=False)
    t = make_tier(tmp_path / "kv")
    assert [p.exists() for p in stale] == [False, False]
    assert young.exists() and foreign.exists() and link.is_symlink() and block.exists()
    t.host[3] = 0
    assert t.load([key(1)], [3]).success
    assert np.array_equal(t.host[3], want)


def test_link_in_a_files_place_is_never_followed(tmp_path, make_tier):
    t = make_tier(tmp_path / "kv")
    _fill(t, 0, 1)
    assert t.store([key(1)], [0]).success
    outside = tmp_path / "outside.bin"
    shutil.copy(t.path(key(1)), outside)  # a valid block file, but outside the tier
    t.path(key(1)).unlink()
    t.path(key(1)).symlink_to(outside)
    assert not t.load([key(1)], [3]).success
    assert t.invalid() == {"unsafe": 1}
    assert not t.path(key(1)).is_symlink()  # the link is removed, its target kept
    assert outside.exists()
    # a dangling link where a store goes: the store replaces the link, writes nothing outside
    target = tmp_path / "written-through-link.bin"
    t.path(key(1)).symlink_to(target)
    assert t.store([key(1)], [0]).success
    assert not target.exists()
    assert not t.path(key(1)).is_symlink()
    assert t.load([key(1)], [3]).success


def test_directory_swapped_for_a_link_is_never_followed(tmp_path, make_tier):
    t = make_tier(tmp_path / "kv")
    _fill(t, 0, 1)
    assert t.store([key(1)], [0]).success
    leaf = t.path(key(1)).parent
    outside = tmp_path / "outside"
    shutil.copytree(leaf, outside)
    shutil.rmtree(leaf)
    leaf.symlink_to(outside, target_is_directory=True)
    assert not t.load([key(1)], [3]).success  # the copy behind the link is not read
    assert t.invalid() == {"unsafe": 1}
    _fill(t, 1, 2)
    before = sorted(os.listdir(outside))
    same_leaf = key(1)[:2] + bytes([9]) * 30 + key(1)[32:]  # another file of that folder
    assert t.path(same_leaf).parent == leaf
    assert not t.store([same_leaf], [1]).success
    assert sorted(os.listdir(outside)) == before  # nothing written outside the tier


def test_fifo_in_a_files_place_does_not_block_the_load(tmp_path, make_tier):
    t = make_tier(tmp_path / "kv")
    _fill(t, 0, 1)
    assert t.store([key(1)], [0]).success
    t.path(key(1)).unlink()
    os.mkfifo(t.path(key(1)))
    assert not t.load([key(1)], [3]).success
    assert t.invalid() == {"unsafe": 1}
    assert not t.path(key(1)).exists()


def test_files_and_directories_of_another_user_are_not_used(tmp_path, make_tier):
    require_root("chown to another user")
    t = make_tier(tmp_path / "kv")
    for i in range(2):
        _fill(t, i, i)
    assert t.store([key(1), key(2)], [0, 1]).success
    os.chown(t.path(key(1)), OTHER_UID, OTHER_UID)
    assert not t.load([key(1)], [3]).success
    assert not t.path(key(1)).exists()  # another user's file is removed, never read
    os.chmod(t.path(key(2)), 0o666)  # ours, but anyone may write it
    assert not t.load([key(2)], [3]).success
    assert t.invalid() == {"unsafe": 2}
    assert t.store([key(1)], [0]).success  # stored anew, as ours
    os.chown(t.path(key(1)).parent, OTHER_UID, OTHER_UID)
    assert not t.load([key(1)], [3]).success  # through another user's folder: a miss
    sibling = key(1)[:2] + bytes([7]) * 30 + key(1)[32:]
    assert t.path(sibling).parent == t.path(key(1)).parent
    assert not t.store([sibling], [0]).success  # nor written into it
    assert not t.path(sibling).exists()


@pytest.mark.parametrize("setup,words", [
    ("world-writable", "writable by group or others (mode 0777)"),
    ("other-owner", f"owned by uid {OTHER_UID}"),
    ("tier-dir-other-owner", f"owned by uid {OTHER_UID}"),
    ("tier-dir-group-writable", "writable by group or others (mode 0770)"),
    ("link", "a symbolic link"),
])
def test_directory_others_can_write_is_refused_at_start(tmp_path, make_tier, setup, words):
    require_root("chown to another user")
    root = tmp_path / "kv"
    root.mkdir()
    probe = Tier(tmp_path / "probe")  # where this spec's tier directory goes
    tier_name = Path(probe.tier._dir.path).name
    probe.close()
    if setup == "world-writable":
        root.chmod(0o777)
    elif setup == "other-owner":
        os.chown(root, OTHER_UID, OTHER_UID)
    elif setup == "link":
        (root / tier_name).symlink_to(tmp_path / "elsewhere", target_is_directory=True)
        (tmp_path / "elsewhere").mkdir()
    else:
        (root / tier_name).mkdir(mode=0o700)
        if setup == "tier-dir-other-owner":
            os.chown(root / tier_name, OTHER_UID, OTHER_UID)
        else:
            (root / tier_name).chmod(0o770)
    with pytest.raises(UnsafePath, match=re.escape(words)):
        make_tier(root)
    if setup == "link":
        assert os.listdir(tmp_path / "elsewhere") == []


def test_sticky_shared_parent_is_accepted(tmp_path, make_tier):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)  # like /tmp
    t = make_tier(shared / "kv")
    _fill(t, 0, 1)
    assert t.store([key(1)], [0]).success
    assert stat.S_IMODE((shared / "kv").stat().st_mode) == 0o700


def test_config_link_is_replaced_not_followed(tmp_path, make_tier):
    probe = Tier(tmp_path / "probe")
    config = Path(probe.tier.file_mapper.get_config_file_path()).relative_to(tmp_path / "probe")
    probe.close()
    root = tmp_path / "kv"
    (root / config).parent.mkdir(parents=True, mode=0o700)
    target = tmp_path / "through-link.json"
    (root / config).symlink_to(target)
    make_tier(root)
    assert not target.exists()
    assert not (root / config).is_symlink()
    assert stat.S_IMODE((root / config).stat().st_mode) == 0o600


# ---------------------------------------------------------------------------------- identity
def test_file_of_another_model_or_layout_is_never_loaded(tmp_path, make_tier):
    root = tmp_path / "kv"
    a = make_tier(root, model="model-a")
    want = _fill(a, 0, 1)
    assert a.store([key(1)], [0]).success
    for other in ({"model": "model-b"}, {"dtype": "bfloat16"}, {"heads": 4}):
        b = make_tier(root, model=other.get("model", "model-a"),
                      **{k: v for k, v in other.items() if k != "model"})
        assert b.path(key(1)).parent != a.path(key(1)).parent  # separate folders
        assert not b.load([key(1)], [2]).success  # a miss: no such file there
        b.path(key(1)).parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        shutil.copy(a.path(key(1)), b.path(key(1)))  # planted in b's folder
        assert not b.load([key(1)], [2]).success
        assert b.invalid() == {"foreign": 1}
        assert not b.path(key(1)).exists()
    # a's own file under a's own layout still loads
    assert a.load([key(1)], [3]).success
    assert np.array_equal(a.host[3], want)
    # and a file stored under one key never loads as another key
    a.path(key(2)).parent.mkdir(parents=True, mode=0o700)
    shutil.copy(a.path(key(1)), a.path(key(2)))
    assert not a.load([key(2)], [4]).success
    assert a.invalid() == {"foreign": 1}


def test_checkpoint_replaced_at_the_same_path_gets_a_new_identity(tmp_path, make_tier):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "weights.safetensors").write_bytes(b"a" * 1000)
    first = weights_identity(str(model))
    assert weights_identity(str(model)) == first  # unchanged files: same identity
    a = make_tier(tmp_path / "kv", model=str(model))
    replaced = tmp_path / "new.safetensors"
    replaced.write_bytes(b"b" * 1000)  # same size, different weights
    os.replace(replaced, model / "weights.safetensors")
    assert weights_identity(str(model)) != first
    b = make_tier(tmp_path / "kv", model=str(model))
    assert b.tier._layout != a.tier._layout
    # rewritten in place (same inode), even with the old modification time put back
    st = (model / "weights.safetensors").stat()
    second = weights_identity(str(model))
    with open(model / "weights.safetensors", "r+b") as f:
        f.write(b"c")
    os.utime(model / "weights.safetensors", ns=(st.st_atime_ns, st.st_mtime_ns))
    assert weights_identity(str(model)) != second
    # a hub id: by revision where nothing is cached
    assert weights_identity("org/none", "v1") != weights_identity("org/none", "v2")


def test_private_dir_refuses_paths_leaving_it(tmp_path):
    d = PrivateDir(str(tmp_path), "kv")
    try:
        for bad in ("../x", "a/../../x", "/etc/x", "a//b", "./a"):
            with pytest.raises(ValueError, match="not a plain relative path"):
                with d.opened(bad, create=True):
                    pass
        with pytest.raises(ValueError, match="outside the KV disk tier"):
            d.relative(str(tmp_path / "elsewhere" / "f.bin"))
        assert not (tmp_path / "x").exists()
    finally:
        d.close()
