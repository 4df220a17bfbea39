"""`write_workload`: a Workload as kvtune JSONL, written atomically.

The records go to a temporary file beside the target, which is renamed over it
only once complete: a reader never sees half a trace, and a failed write
leaves any earlier file untouched.
"""
from __future__ import annotations

import json
import os
import tempfile

from .kvtune_jsonl import record_of
from .model import Workload


def write_workload(workload: Workload, path: str | os.PathLike) -> None:
    """Write `workload` as kvtune JSONL (timestamps in milliseconds)."""
    target = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(target))
    handle, temporary = tempfile.mkstemp(prefix=f".{os.path.basename(target)}.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(handle, "w", encoding="utf-8", newline="\n") as file:
            for request in workload.requests:
                record = record_of(request, workload.hash_block_size)
                file.write(json.dumps(record, separators=(",", ":")))
                file.write("\n")
            file.flush()
            os.fsync(file.fileno())
        os.chmod(temporary, _mode_for(target))
        os.replace(temporary, target)
    except BaseException:
        os.unlink(temporary)
        raise


def _mode_for(target: str) -> int:
    """Keep the mode of the file being replaced; a new one gets rw-r--r--."""
    try:
        return os.stat(target).st_mode & 0o777
    except FileNotFoundError:
        return 0o644
