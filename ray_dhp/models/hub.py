"""Model ids as well as directories: ``"Qwen/Qwen2.5-VL-7B-Instruct"`` resolves through the Hugging
Face cache.

`resolve_model_path` runs in the driver (``DHPConfig``, the run file), before any worker starts:

1. an existing local directory is used as is (made absolute);
2. otherwise a name shaped like a Hub repo id (``org/name``) is looked up in the Hugging Face
   cache (``HF_HUB_CACHE``, default ``~/.cache/huggingface/hub``) without network
   (``snapshot_download(..., local_files_only=True)``): a cached snapshot's directory is used;
3. if it is not cached and the Hub is reachable (``HF_HUB_OFFLINE`` unset), it is downloaded
   into the cache once (``snapshot_download``);
4. otherwise a ``ValueError`` names the key and says how to download it.

Workers receive the resolved directory: on a multi-node cluster every node must see it (a shared
``HF_HOME``, or download on every node).
"""

from __future__ import annotations

import os
import re
from typing import Optional

_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*$")


def looks_like_repo_id(name: str) -> bool:
    """``org/name`` with Hub-legal characters (a relative path like ``models/x`` also matches:
    a directory of that name wins, see `resolve_model_path`)."""
    return bool(_REPO_ID.match(name)) and ".." not in name


def hub_cache_dir() -> str:
    """The Hugging Face hub cache, read from the environment at call time."""
    from huggingface_hub import constants

    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    if os.environ.get("HF_HOME"):
        return os.path.join(os.environ["HF_HOME"], "hub")
    return constants.HF_HUB_CACHE


def _offline() -> bool:
    from huggingface_hub import constants

    env = os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")
    return env or bool(constants.HF_HUB_OFFLINE)


def resolve_model_path(spec, key: str = "model.path", download: Optional[bool] = None) -> str:
    """A local directory for ``spec`` (a directory or a Hub repo id); ValueError naming ``key``.

    Args:
        spec: a path or ``org/name``.
        key: the setting being resolved, for the error message.
        download: fetch an uncached repo id from the Hub (None: unless ``HF_HUB_OFFLINE``).
    """
    text = os.fspath(spec)
    path = os.path.abspath(os.path.expanduser(text))
    if os.path.isdir(path):
        return path
    if not looks_like_repo_id(text):
        raise ValueError(f"{key}={text!r}: {path} is not a local directory, and not a Hugging Face "
                         "model id (org/name). Give a local model directory or an id such as "
                         "Qwen/Qwen2.5-VL-7B-Instruct.")
    from huggingface_hub import snapshot_download

    cache = hub_cache_dir()
    try:
        return snapshot_download(text, cache_dir=cache, local_files_only=True)
    except Exception:  # noqa: BLE001 - not cached (LocalEntryNotFoundError and friends)
        pass
    reason = "HF_HUB_OFFLINE is set"
    if download if download is not None else not _offline():
        try:
            return snapshot_download(text, cache_dir=cache)
        except Exception as e:  # noqa: BLE001 - unreachable, gated, unknown repo...
            reason = f"downloading it failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
    raise ValueError(
        f"{key}={text!r}: not a local directory and not in the Hugging Face cache ({cache}); "
        f"{reason}. Download it first on a machine with access to the Hub:\n"
        f"    hf download {text}        (or: huggingface-cli download {text})\n"
        f"with the same HF_HOME / HF_HUB_CACHE as this run (every node of a cluster must see "
        f"it), or set {key} to a local directory holding config.json and the weights.")
