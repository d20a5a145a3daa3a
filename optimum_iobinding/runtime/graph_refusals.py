"""What ONNX Runtime answered when a model file was asked for one session that captures a graph per input shape,
kept across processes.

ORT refuses such a session where, with the input dims left free, it places nodes on the CPU (a text encoder's shape
arithmetic: "all compute graph nodes have not been partitioned"); the model's signatures then get a session each, with
their dims fixed (:class:`~.graph_pool.GraphPool`). The refusal is the same at every load of the same file, and asking
costs a whole session build on the first image's path. So the refusal is remembered per file — its real path, size and modification
time — per onnxruntime version, provider and provider options, in a small JSON file under the user's cache folder
(``$XDG_CACHE_HOME/optimum-iobinding/``, else ``~/.cache/optimum-iobinding/``); a changed file or another onnxruntime
asks again. Only placement refusals are remembered (not an out-of-memory or other passing failure), and none where
the user gave ``sess_options`` (which can change what ORT places where). A cache folder that cannot be written
changes nothing but the time: every load then asks ORT, as without this file.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from typing import Dict, Mapping, Optional

import onnxruntime as ort

logger = logging.getLogger(__name__)

CACHE_FILE = "one-session-refusals.json"
MAX_ENTRIES = 512  # the oldest go first beyond this
# provider options that differ from one process to the next and say nothing about placement
_PER_PROCESS_OPTIONS = frozenset({"user_compute_stream", "has_user_compute_stream"})


def refusals_path() -> str:
    """The JSON file the refusals are kept in."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "optimum-iobinding", CACHE_FILE)


def file_key(path: str, provider: str, options: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """The key of ``path`` as it is now, for ``provider`` with ``options`` and this onnxruntime; ``None`` where the
    file is gone."""
    try:
        status = os.stat(path)
    except OSError:
        return None
    settings = sorted((str(k), str(v)) for k, v in (options or {}).items() if k not in _PER_PROCESS_OPTIONS)
    return json.dumps([os.path.realpath(path), status.st_size, status.st_mtime_ns, ort.__version__, provider, settings])


def _read() -> Dict[str, str]:
    try:
        with open(refusals_path(), encoding="utf-8") as handle:
            entries = json.load(handle)
    except (OSError, ValueError):  # none yet, unreadable or not JSON: nothing remembered
        return {}
    if not isinstance(entries, dict):
        return {}
    return {key: value for key, value in entries.items() if isinstance(key, str) and isinstance(value, str)}


def remembered_refusal(path: str, provider: str, options: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """ORT's reason for refusing ``path`` one graph session on ``provider`` with ``options`` at an earlier load, or
    ``None``."""
    key = file_key(path, provider, options)
    return None if key is None else _read().get(key)


def remember_refusal(path: str, provider: str, reason: str, options: Optional[Mapping[str, str]] = None) -> None:
    """Keeps ORT's ``reason`` for refusing ``path`` one graph session on ``provider`` with ``options``; a cache
    folder that cannot be written is logged (DEBUG) and left."""
    key = file_key(path, provider, options)
    if key is None:
        return
    entries = _read()
    entries.pop(key, None)
    entries[key] = reason[:2000]
    while len(entries) > MAX_ENTRIES:
        entries.pop(next(iter(entries)))
    target = refusals_path()
    try:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        # written beside and moved into place: a reader never sees half a file, a writer never truncates another's
        handle, scratch = tempfile.mkstemp(dir=os.path.dirname(target), prefix=".refusals-", suffix=".json")
        try:
            with os.fdopen(handle, "w", encoding="utf-8") as out:
                json.dump(entries, out)
            os.replace(scratch, target)
        except BaseException:
            os.unlink(scratch)
            raise
    except OSError as error:
        logger.debug("could not remember a one-session refusal in %s: %s", target, error)
