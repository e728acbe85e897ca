"""The HBM watch's request directory: checked when the agent starts (created when missing), and
checkpoint request files written into it without following any path after the file is created.

The agent runs as root; jobs of other users read the requests (and the checkpoint helper writes its
`<id>.done.json` beside them). A directory anyone may write without the sticky bit would let them
swap the agent's temporary file for a symlink, so the agent refuses one (and a symlink, and one not
owned by root or the agent's user). Created here, and by the units and the DaemonSet, as 1777: like
/tmp, everyone may add files, only a file's owner may rename or remove it.
"""

from __future__ import annotations

import json
import os
import stat
import tempfile

from xpusense.common.fsync import fsync_dir

DIR_MODE = 0o1777      # the mode the agent gives a request directory it creates
FILE_MODE = 0o644      # requests are readable by every job


class RequestDirError(Exception):
    """A request directory the agent must not write into (the message says why and what to do)."""


def _problem(path: str, st: os.stat_result, uid: int) -> str | None:
    """Why the agent must not write into `path` (None when it may)."""
    mode = stat.S_IMODE(st.st_mode)
    if stat.S_ISLNK(st.st_mode):
        return f"{path} is a symlink (to {os.readlink(path)!r}): give the real directory"
    if not stat.S_ISDIR(st.st_mode):
        return f"{path} is not a directory"
    if st.st_uid not in (0, uid):
        return f"{path} is owned by uid {st.st_uid}, not root or the agent's uid {uid}: chown it to one of them"
    if mode & (stat.S_IWGRP | stat.S_IWOTH) and not mode & stat.S_ISVTX:
        return (f"{path} has mode {mode:04o}: writable by group or others without the sticky bit, so another "
                f"user could swap the agent's request files for symlinks; chmod 1777 {path} (anyone may add "
                f"files, only their owner may rename them) or 0755")
    return None


def dir_problem(path: str, uid: int | None = None) -> str | None:
    """Why the agent must not write into `path` now (None when it may), a missing one included."""
    try:
        st = os.lstat(path)
    except OSError as e:
        return f"cannot read {path}: {e.strerror}"
    return _problem(path, st, os.geteuid() if uid is None else uid)


def prepare_request_dir(path: str, uid: int | None = None) -> str | None:
    """At start-up: create `path` (mode 1777) when missing; raise RequestDirError when it is unsafe to
    write. Returns why it could not be made (no right to; a warning: each request says it again, and
    a directory made later is checked before every write), None when it is ready."""
    try:
        os.lstat(path)
    except FileNotFoundError:
        try:
            os.makedirs(os.path.dirname(os.path.abspath(path)), 0o755, exist_ok=True)
            os.mkdir(path, 0o700)
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
            try:
                os.fchmod(fd, DIR_MODE)   # on what was made, never by path (umask would clear bits)
            finally:
                os.close(fd)
        except OSError as e:
            return f"cannot create {path}: {e.strerror}"
    if why := dir_problem(path, uid):
        raise RequestDirError(f"hbm_watch.request_dir: {why}")
    return None


def write_atomically(directory: str, name: str, data: dict) -> str:
    """Write `data` as JSON to `directory/name`: a new temporary file (O_CREAT|O_EXCL|O_NOFOLLOW,
    mkstemp), its mode set on the descriptor, fsync'd, renamed into place, the directory fsync'd.
    Raises OSError: the directory is unsafe or missing (dir_problem), the temporary name no longer
    names the file written (swapped), or the write failed."""
    if why := dir_problem(directory):
        raise OSError(why)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-", suffix=".json")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=2)
            f.flush()
            os.fchmod(f.fileno(), FILE_MODE)
            os.fsync(f.fileno())
            mine = os.fstat(f.fileno())
        now = os.lstat(tmp)
        if (now.st_dev, now.st_ino) != (mine.st_dev, mine.st_ino):
            raise OSError(f"{tmp} was replaced by another file after the agent created it: request not written")
        path = os.path.join(directory, name)
        os.replace(tmp, path)
        fsync_dir(directory)
        return path
    except BaseException:
        try:
            os.unlink(tmp)   # the name only: a symlink put there is removed, never followed
        except OSError:
            pass
        raise
