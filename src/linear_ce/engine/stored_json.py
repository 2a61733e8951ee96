"""What the package keeps between runs (a measured plan, a compiled library's record) is
plain JSON written atomically: a reader sees the whole new file or the one before, never
a part, even after a crash or a full disk (the data and its folder are synced before and
after the rename)."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

__all__ = ["write_json"]


def write_json(path: Path, data: Any, **dump: Any) -> None:
    """``data`` as JSON in ``path`` (``dump``: :func:`json.dump`'s options), atomically."""
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(handle, "w") as out:
            json.dump(data, out, **dump)
            out.flush()
            os.fsync(out.fileno())
        os.replace(temporary, path)
    except BaseException:
        os.unlink(temporary)
        raise
    folder = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(folder)
    finally:
        os.close(folder)
