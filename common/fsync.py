"""Durable renames: after a file is renamed into a directory, the directory itself must be fsync'd
for the new name to survive a crash."""

from __future__ import annotations

import os


def fsync_dir(directory: str) -> None:
    """fsync a directory (its entries: names created, renamed or removed in it)."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
