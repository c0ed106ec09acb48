"""A directory tree only this user can write, used without following symbolic links.

The disk tier (:mod:`vllm_unified.offload.disk`) keeps its files below one directory, the *tier
directory*. :class:`PrivateDir` opens it once at start-up and keeps its file descriptor; every
later operation starts from that descriptor and walks the rest of the path one component at a
time (``openat`` with ``O_NOFOLLOW | O_DIRECTORY``), so no symbolic link below the tier
directory is ever followed, and a path cannot leave it (``..``, ``.`` and empty components are
refused). File operations then use the leaf directory's descriptor (``dir_fd=``) and
``O_NOFOLLOW``.

Who may write what:

* the tier directory and everything below it must be owned by this process's effective user and
  not writable by group or others (:func:`unsafe_reason`); directories created here are
  ``0700``;
* the directories above it (the configured ``root_dir`` and its ancestors, resolved once with
  ``realpath``, so a link the operator chose, such as macOS's ``/tmp``, is fine) must be owned by
  root or this user and not writable by group or others unless sticky (``/tmp``), the rule
  OpenSSH applies to ``~/.ssh``. Otherwise another user could swap the directory for one of
  theirs.

A violation is an :class:`UnsafePath` (an ``OSError``) naming the path, its owner and mode.
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Iterator

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class UnsafePath(OSError):
    """A path the disk tier refuses to use (a symlink, the wrong file type, another owner, or
    writable by group/others)."""


def unsafe_reason(st: os.stat_result, *, kind: str, owners: tuple[int, ...] | None = None,
                  sticky_ok: bool = False) -> str | None:
    """Why a file or directory with status ``st`` (from ``lstat``/``fstat``) must not be used,
    or None.

    Args:
        kind: ``"dir"`` or ``"file"`` (a regular file).
        owners: accepted owners (default: this process's effective user only).
        sticky_ok: group/other write permission is accepted on a sticky directory.
    """
    owners = owners or (os.geteuid(),)
    if kind == "dir" and not stat.S_ISDIR(st.st_mode):
        return "not a directory" if not stat.S_ISLNK(st.st_mode) else "a symbolic link"
    if kind == "file" and not stat.S_ISREG(st.st_mode):
        return "not a regular file" if not stat.S_ISLNK(st.st_mode) else "a symbolic link"
    if st.st_uid not in owners:
        return f"owned by uid {st.st_uid}, not {' or '.join(map(str, owners))}"
    writable = st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
    if writable and not (sticky_ok and st.st_mode & stat.S_ISVTX):
        return f"writable by group or others (mode {stat.S_IMODE(st.st_mode):04o})"
    return None


def _parts(relative: str) -> list[str]:
    """The components of a ``/``-separated path below a directory.

    Raises:
        ValueError: an absolute path, or an empty, ``.`` or ``..`` component.
    """
    if not relative:
        return []
    parts = relative.split("/")
    if relative.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise ValueError(f"{relative!r} is not a plain relative path")
    return parts


class PrivateDir:
    """The tier directory ``name`` inside ``parent``, created (``0700``, with missing parents)
    or checked, and held open. ``parent`` (the configured ``root_dir``) is resolved once with
    ``realpath``; ``name`` and everything below it are never followed if they are links.

    Raises:
        UnsafePath: the tier directory or one of its ancestors breaks the rules of this
            module.
        OSError: it cannot be created or opened.
        ValueError: ``name`` is not one plain path component.
    """

    def __init__(self, parent: str, name: str) -> None:
        if len(_parts(name)) != 1:
            raise ValueError(f"{name!r} is not one path component")
        self.path = os.path.join(os.path.realpath(parent), name)
        uid = os.geteuid()
        fd = os.open("/", _DIR_FLAGS)
        try:
            where = ""
            parts = _parts(self.path.lstrip("/"))
            for i, part in enumerate(parts):
                where += "/" + part
                last = i == len(parts) - 1
                parent_fd, fd = fd, -1  # _step closes the parent
                fd = self._step(parent_fd, part, where, create=True,
                                owners=(uid,) if last else (0, uid), sticky_ok=not last)
        except BaseException:
            if fd >= 0:
                os.close(fd)
            raise
        self.fd = fd

    @staticmethod
    def _step(parent: int, name: str, where: str, *, create: bool, owners: tuple[int, ...],
              sticky_ok: bool) -> int:
        """Open directory ``name`` of ``parent`` without following a link (creating it 0700
        when missing and ``create``), check it, close ``parent``; return the new descriptor."""
        try:
            try:
                fd = os.open(name, _DIR_FLAGS, dir_fd=parent)
            except FileNotFoundError:
                if not create:
                    raise
                with contextlib.suppress(FileExistsError):
                    os.mkdir(name, 0o700, dir_fd=parent)
                fd = os.open(name, _DIR_FLAGS, dir_fd=parent)
        except OSError as exc:
            st = _lstat(parent, name)
            reason = st and unsafe_reason(st, kind="dir", owners=owners, sticky_ok=sticky_ok)
            if reason:
                raise UnsafePath(exc.errno, f"KV disk tier: {where} is {reason}") from None
            raise
        finally:
            os.close(parent)
        reason = unsafe_reason(os.fstat(fd), kind="dir", owners=owners, sticky_ok=sticky_ok)
        if reason:
            os.close(fd)
            raise UnsafePath(f"KV disk tier: {where} is {reason}")
        return fd

    def relative(self, path: str) -> tuple[str, str]:
        """``(directory, name)`` of ``path`` (absolute, below this directory) relative to it.

        Raises:
            ValueError: ``path`` is not below this directory, or is not a plain path.
        """
        prefix = self.path.rstrip("/") + "/"
        if not path.startswith(prefix):
            raise ValueError(f"{path} is outside the KV disk tier {self.path}")
        parts = _parts(path[len(prefix):])
        if not parts:
            raise ValueError(f"{path} names no file")
        return "/".join(parts[:-1]), parts[-1]

    @contextlib.contextmanager
    def opened(self, relative: str, *, create: bool = False) -> Iterator[int]:
        """A descriptor of directory ``relative`` (``/``-separated, ``""`` for this one),
        walked without following links, each level checked; created (0700) when ``create``.

        Raises:
            UnsafePath: a component is a link, not a directory, another user's, or writable
                by group/others.
            FileNotFoundError: a component is missing (and not ``create``).
            ValueError: ``relative`` is not a plain relative path.
        """
        fd = os.dup(self.fd)
        try:
            where = self.path
            for name in _parts(relative):
                where += "/" + name
                parent, fd = fd, -1  # _step closes the parent
                fd = self._step(parent, name, where, create=create, owners=(os.geteuid(),),
                                sticky_ok=False)
        except BaseException:
            if fd >= 0:
                os.close(fd)
            raise
        try:
            yield fd
        finally:
            os.close(fd)

    def close(self) -> None:
        """Close the held descriptor (idempotent)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _lstat(dir_fd: int, name: str) -> os.stat_result | None:
    try:
        return os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except OSError:
        return None
