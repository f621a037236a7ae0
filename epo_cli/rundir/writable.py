"""Folders a command writes its results into, checked before any work: one message naming the setting.

A file where the folder should be, a read-only run directory (an `epo eval` or `epo report` of a run that
someone shared read-only), or a full disk would otherwise surface as an OSError once the work is done.
`json_ready` makes the values written into such a folder's JSON files strict JSON.

Writing into a folder epo owns (a run, sweep or eval folder) never follows what is already there: a received
folder may hold `.epo.lock`, `status.json` or `checkpoints/latest` as a symlink to a file outside it, or as a
FIFO or a device. `open_for_writing` (and `write_file` on top of it) opens without following symlinks
(O_NOFOLLOW), without blocking on a FIFO, and refuses any entry that is not a regular file with one message
naming it (UnsafeEntryError); `check_entries` checks the entries a library writes for epo (DeepSpeed's
checkpoint files, TensorBoard's events) before it writes them.
"""

from __future__ import annotations

import errno
import math
import os
import stat
from pathlib import Path
from typing import IO, Any

from epo_cli.errors import UserError


def check_output_dir(path: Path, key: str, entries: bool = False) -> Path:
    """Make sure the folder a command will write its results into can be made and written, without creating
    anything yet: one UserError naming the setting (`key`) and the path when it, or the nearest part of it
    that exists, is a file, or when that part cannot be written (a read-only run directory, a full disk).
    `entries`: an existing folder's entries are checked too (check_entries), for results written by libraries
    that follow symlinks (matplotlib's PNGs of `epo report` into a received run's plots/)."""
    path = Path(path).expanduser()
    existing = next((p for p in (path, *path.parents) if p.exists()), Path("/"))
    if not existing.is_dir():
        shown = f"'{path}' is a file" if existing == path else f"'{existing}' (in '{path}') is a file"
        raise UserError(f"{key}: {shown}, not a folder. Choose a folder ({key}=DIR).")
    if entries and existing == path:
        check_entries(path)
    probe = existing / f".epo-write-check-{os.getpid()}"
    try:
        probe.write_text("")
        probe.unlink()
    except OSError as err:
        why = err.strerror or type(err).__name__
        raise UserError(f"{key}: cannot write into '{existing}' ({why}), so '{path}' cannot be written. Choose "
                        f"a writable folder ({key}=DIR), or make this one writable / free disk space.") from None
    return path


def prepare_output_dir(path: Path, key: str) -> Path:
    """check_output_dir, then create the folder."""
    path = check_output_dir(path, key)
    path.mkdir(parents=True, exist_ok=True)
    return path


def json_ready(value: Any) -> Any:
    """`value` with every NaN/inf float as None, through dicts, lists and tuples: NaN/inf are not JSON (an
    interval over zero episodes, a metric of a run that diverged), and json.dumps(allow_nan=False) refuses them."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: json_ready(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_ready(v) for v in value]
    return value


class UnsafeEntryError(UserError):
    """An entry where epo writes that is not a regular file of its own (a symlink, a FIFO, a device, a folder,
    a hard link to another file): refused, naming it, before anything is written through it."""

    def __init__(self, path: Path, what: str) -> None:
        self.path = Path(path)
        super().__init__(f"'{path}' is {what}, where epo writes one of its own files: epo never writes through "
                         "an entry it did not make (a symlink or a hard link could name a file outside the "
                         "folder; a FIFO or a device would block or swallow the write). Nothing was written to it. "
                         f"Remove it (rm '{path}') if the folder is yours, or use a fresh folder.")


def _describe(path: Path, info: os.stat_result) -> str | None:
    """What is wrong with an entry epo is about to write (from lstat), or None for a regular file of one link."""
    mode = info.st_mode
    if stat.S_ISLNK(mode):
        try:
            target = os.readlink(path)
        except OSError:
            target = "?"
        return f"a symlink (to '{target}')"
    for test, name in ((stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a folder")):
        if test(mode):
            return name
    if not stat.S_ISREG(mode):
        return "not a regular file"
    if info.st_nlink > 1:
        return f"a hard link ({info.st_nlink} names for one file)"
    return None


def check_entry(path: Path, folder: bool = False) -> None:
    """The entry at `path` is absent, or a regular file (`folder=True`: a real folder, not a symlink to one)
    epo may write; else UnsafeEntryError."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return
    if folder and stat.S_ISDIR(info.st_mode):
        return
    what = _describe(Path(path), info)
    if what is not None or folder:
        raise UnsafeEntryError(path, what or "a file where a folder must be")


def check_entries(folder: Path) -> None:
    """Every entry under `folder` (not through symlinks; `folder` itself is the user's to name) is a real
    folder or a regular file (hard links allowed: `cp -al` copies of a run; epo's own in-place writes refuse
    them): checked before libraries that follow symlinks (DeepSpeed's torch.save, save_pretrained, Hydra)
    write into it."""
    for root, dirs, files in os.walk(folder):
        for name in dirs + files:  # os.walk lists a symlink to a folder among `dirs`, and never enters it
            path = Path(root) / name
            try:
                info = os.lstat(path)
            except FileNotFoundError:  # removed meanwhile
                continue
            if stat.S_ISDIR(info.st_mode) or (stat.S_ISREG(info.st_mode)):
                continue
            raise UnsafeEntryError(path, _describe(path, info) or "not a regular file")


def refuse_unsafe(path: Path, err: OSError) -> None:
    """After os.open(path, O_NOFOLLOW | O_NONBLOCK, ...) failed with `err`: UnsafeEntryError naming what is
    there when the failure means "not a regular file" (a symlink: ELOOP; a FIFO without a reader: ENXIO; a
    folder: EISDIR); otherwise nothing (the caller re-raises `err`)."""
    if err.errno in (errno.ELOOP, errno.ENXIO, errno.EISDIR, errno.ETXTBSY, errno.EWOULDBLOCK):
        try:
            info = os.lstat(path)
        except OSError:
            return
        raise UnsafeEntryError(path, _describe(Path(path), info) or "not a regular file") from None


def check_opened(path: Path, fd: int) -> None:
    """The file just opened at `path` is a regular file of one link (fstat), else UnsafeEntryError."""
    what = _describe(Path(path), os.fstat(fd))
    if what is not None:
        raise UnsafeEntryError(path, what)


def open_for_writing(path: Path, append: bool = False, binary: bool = False, truncate: bool = True) -> IO[Any]:
    """`path` opened for writing (truncated, or `append`ed to; `truncate=False`: rewritten in place from its
    start, for a full disk), created if missing, never through a symlink (O_NOFOLLOW), a FIFO (O_NONBLOCK,
    then fstat), a device or a hard link: UnsafeEntryError naming it. Other OSErrors (a full disk, a read-only
    folder) are the caller's, as for open()."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
    flags |= os.O_APPEND if append else 0
    try:
        fd = os.open(path, flags, 0o644)
    except OSError as err:
        refuse_unsafe(path, err)
        raise
    try:
        check_opened(path, fd)
        os.set_blocking(fd, True)
        if not append and truncate:
            os.ftruncate(fd, 0)  # only now: a refused entry is never truncated
    except BaseException:
        os.close(fd)
        raise
    return os.fdopen(fd, ("a" if append else "w") + ("b" if binary else ""))


def write_file(path: Path, data: str | bytes, atomic: bool = True) -> None:
    """Write `data` to `path` in a folder epo owns (open_for_writing's rules for every entry it touches).
    `atomic`: into `<path>.tmp` first, then renamed over `path` (a reader never sees half a file; the rename
    replaces a planted entry at `path` itself instead of writing through it, but `path` is checked anyway so
    that a planted entry is named, not silently replaced)."""
    path = Path(path)
    if not atomic:
        with open_for_writing(path, binary=isinstance(data, bytes)) as f:
            f.write(data)
        return
    check_entry(path)
    tmp = path.with_name(path.name + ".tmp")
    with open_for_writing(tmp, binary=isinstance(data, bytes)) as f:
        f.write(data)
    tmp.replace(path)
