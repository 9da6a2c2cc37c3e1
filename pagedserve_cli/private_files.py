"""Secrets `up` and `serve` hand to their children in files only this user can read: a secret on a child's command
line or in a world-readable file would be every local user's (`ps`, /proc/PID/cmdline)."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile


def private_file(name: str, text: str) -> str:
    """The path of a new file holding `text`, mode 0600 in a fresh folder of mode 0700, both removed when this
    process exits. NOTE: O_EXCL: the file is this call's own, never one another process put there first."""
    folder = tempfile.mkdtemp(prefix="pagedserve-")  # NOTE: mkdtemp makes it 0700
    atexit.register(shutil.rmtree, folder, True)
    path = os.path.join(folder, name)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    return path
