"""Which checkpoint a disk-tier file was computed with.

vLLM names a model by its path or hub id (``model_config.model``), and its fs tier keys its
folder with that name: a checkpoint replaced at the same path (a new fine-tune, a re-quantized
file) would be served KV computed with the old weights. The disk tier
(:func:`vllm_unified.offload.disk.layout_fields`) therefore also keys its folder and every
file's layout digest with :func:`weights_identity`, which costs a few ``stat`` calls (nothing
is read):

* a local file or folder: for each regular file at its top level (links followed, as the
  loader follows them; a prepared GGUF folder's ``model.gguf`` link included), its name, size,
  inode, modification and status-change times. Rewriting, replacing or touching any of them
  (``config.json`` included, whose RoPE settings change the keys) changes the identity; the
  status-change time cannot be set back by a user, so a copy made with ``cp -p`` is a new
  identity too. A restarted server on unchanged files keeps its identity and finds its blocks.
* a hub id: the commit of the snapshot in the local Hugging Face cache that ``revision``
  (default ``main``) resolves to, or the revision string where no snapshot is cached.
"""

from __future__ import annotations

import hashlib
import os


def weights_identity(model: str, revision: str | None = None) -> str:
    """A hex digest identifying the files of checkpoint ``model`` (see the module docstring).

    Args:
        model: a local file or folder, or a hub id.
        revision: the hub revision vLLM was given (``--revision``); ignored for local paths.
    """
    if os.path.exists(model):
        return _local_identity(os.path.realpath(model))
    return hashlib.sha256(f"hub:{model}@{_hub_commit(model, revision)}".encode()).hexdigest()


def _local_identity(path: str) -> str:
    if os.path.isfile(path):
        entries = [(os.path.basename(path), path)]
    else:
        entries = sorted((name, os.path.join(path, name)) for name in os.listdir(path))
    h = hashlib.sha256()
    for name, full in entries:
        try:
            st = os.stat(full)
        except FileNotFoundError:  # a dangling link: nothing the loader could read
            continue
        if not os.path.isfile(full):
            continue
        h.update(f"{name}\0{st.st_size}\0{st.st_ino}\0{st.st_mtime_ns}\0{st.st_ctime_ns}\n"
                 .encode())
    return h.hexdigest()


def _hub_commit(model: str, revision: str | None) -> str:
    """The cached snapshot's commit for ``revision``, else the revision itself."""
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return revision or "main"
    try:
        found = try_to_load_from_cache(model, "config.json", revision=revision)
    except ValueError:  # not a hub id either (a path that does not exist): the name alone
        return revision or "main"
    if isinstance(found, str):  # .../snapshots/<commit>/config.json
        return os.path.basename(os.path.dirname(found))
    return revision or "main"
