"""The one way epo reads a file it received: as bounded data.

A run directory, a model folder, a games cache or a file named on the command line (`epo plan --throughput`)
may come from anyone, so none of its files is read "whatever it is": `read_bytes` (and `read_text`,
`read_json` on top of it) reads a file only when

    it is a regular file      a FIFO would block the read forever, /dev/zero never ends, a folder or a socket
                              is not a file: opened without blocking, then checked with fstat
    symlinks stay inside      with `within=<folder>`, a symlink may point only inside that folder (a received
                              folder cannot make epo read ~/.ssh/id_rsa into an error message or a model)
    it is at most its cap     LIMITS: one cap per kind of file, checked with fstat and again while reading
    JSON nests at most        MAX_JSON_DEPTH levels (200000 brackets would be a RecursionError in json)

and otherwise raises ReceivedFileError: one message naming the file, what it is, and the limit. Callers that
can go on without a file (a damaged status.json reads as `unknown`) catch it like any other damage.
"""

from __future__ import annotations

import errno
import itertools
import json
import os
import re
import stat
from pathlib import Path
from typing import Any

from epo_cli.errors import UserError

MiB = 1024 * 1024

#: the largest file of each kind epo reads (the sizes epo itself writes are far below each)
LIMITS: dict[str, int] = {
    "run config": 4 * MiB,  # config.yaml, .hydra/*.yaml: about 10 KB
    "trainer state": 64 * MiB,  # trainer_state.json: counters and histories, well under 1 MB
    "status": 4 * MiB,  # status.json: a few alerts
    "metrics": 512 * MiB,  # metrics.jsonl: ~2 KB a step
    "pointer": 4096,  # checkpoints/latest, best, a COMPLETE marker: one name or number
    "model config": 16 * MiB,  # config.json, tokenizer_config.json, generation_config.json, an index
    "tokenizer": 128 * MiB,  # tokenizer.json, vocab.json, merges.txt, tokenizer.model: the largest are ~35 MB
    "safetensors header": 100_000_000,  # the safetensors library's own limit
    "throughput": 4 * MiB,  # `epo plan --throughput`: one measured JSON object
    "sweep record": 4 * MiB,  # sweep.json, sweep_job.json, a rank's relay file
    "games cache": 64 * MiB,  # a cached game's JSON
    "demonstrations": 4096 * MiB,  # algo.demos: JSONL trajectories, read whole
    "weights": 1 << 50,  # pytorch_model.bin: torch reads it; only its kind is checked here
}
#: the deepest nesting of a JSON file epo reads (its own files nest 5 levels; tokenizer.json about 6)
MAX_JSON_DEPTH = 100


class ReceivedFileError(UserError):
    """A received file epo does not read: `path`, and `reason` (what it is, and the limit)."""

    def __init__(self, path: Path, reason: str, kind: str) -> None:
        self.path, self.reason, self.kind = Path(path), reason, kind
        super().__init__(f"'{path}' {reason}; epo reads a received {kind} file only as a regular file within its "
                         f"folder, at most {_size(LIMITS.get(kind, 0))} and nested at most {MAX_JSON_DEPTH} levels. "
                         "Nothing was read from it: replace it with the real file (copy the folder again from "
                         "where it came from).")


def _size(n: int) -> str:
    return f"{n // MiB} MiB" if n >= MiB else f"{n} bytes"


def _kind_of(mode: int) -> str:
    for test, name in ((stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a folder")):
        if test(mode):
            return name
    return "not a regular file"


def _outside(path: Path, within: Path) -> Path | None:
    """Where `path` really is when that is outside `within` (through a symlink on the way), else None."""
    real, root = path.resolve(), within.resolve()
    return None if real == root or root in real.parents else real


def check_regular(path: Path, kind: str, within: Path | None = None) -> os.stat_result:
    """`path` is a regular file (symlinks followed, and with `within` only inside it), at most LIMITS[kind]
    bytes: its stat, or ReceivedFileError. For files another library then reads (a tokenizer's files)."""
    path = Path(path)
    if within is not None and (real := _outside(path, within)) is not None:
        raise ReceivedFileError(path, f"is a symlink to '{real}', outside the folder '{within}'", kind)
    try:
        info = os.stat(path)
    except OSError as err:
        raise ReceivedFileError(path, f"cannot be read ({err.strerror or err})", kind) from None
    if not stat.S_ISREG(info.st_mode):
        raise ReceivedFileError(path, f"is {_kind_of(info.st_mode)}, not a regular file", kind)
    if info.st_size > LIMITS[kind]:
        raise ReceivedFileError(path, f"is {info.st_size} bytes long, more than the {_size(LIMITS[kind])} epo "
                                f"reads of a {kind} file", kind)
    return info


def read_bytes(path: Path, kind: str, within: Path | None = None, limit: int | None = None) -> bytes:
    """The bytes of a received file of `kind` (LIMITS), read only as the module docstring says; `limit`
    lowers the cap (e.g. the bytes a header announces). FileNotFoundError is left to the caller (a missing
    file is usually expected); anything else is ReceivedFileError."""
    path = Path(path)
    cap = min(LIMITS[kind], limit) if limit is not None else LIMITS[kind]
    if within is not None and (real := _outside(path, within)) is not None:
        raise ReceivedFileError(path, f"is a symlink to '{real}', outside the folder '{within}'", kind)
    try:  # O_NONBLOCK: opening a FIFO without a writer would wait forever
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except FileNotFoundError:
        raise
    except OSError as err:
        if err.errno == errno.EISDIR:
            raise ReceivedFileError(path, "is a folder, not a regular file", kind) from None
        raise ReceivedFileError(path, f"cannot be read ({err.strerror or err})", kind) from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ReceivedFileError(path, f"is {_kind_of(info.st_mode)}, not a regular file", kind)
        if info.st_size > cap:
            raise ReceivedFileError(path, f"is {info.st_size} bytes long, more than the {_size(cap)} epo reads "
                                    f"of a {kind} file", kind)
        chunks, total = [], 0
        while True:  # never more than cap + 1 bytes, whatever fstat said (a file still growing)
            chunk = os.read(fd, min(cap + 1 - total, 16 * MiB))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
            if total > cap:
                raise ReceivedFileError(path, f"holds more than the {_size(cap)} epo reads of a {kind} file", kind)
        return b"".join(chunks)
    except OSError as err:
        raise ReceivedFileError(path, f"cannot be read ({err.strerror or err})", kind) from None
    finally:
        os.close(fd)


def read_prefix(path: Path, kind: str, nbytes: int, within: Path | None = None) -> tuple[bytes, int]:
    """The first `nbytes` (at most LIMITS[kind]) of a received regular file of any size, and its size: for a
    header (a safetensors file's). The same rules as read_bytes except the cap on the whole file."""
    path = Path(path)
    if within is not None and (real := _outside(path, within)) is not None:
        raise ReceivedFileError(path, f"is a symlink to '{real}', outside the folder '{within}'", kind)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except FileNotFoundError:
        raise
    except OSError as err:
        raise ReceivedFileError(path, f"cannot be read ({err.strerror or err})", kind) from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ReceivedFileError(path, f"is {_kind_of(info.st_mode)}, not a regular file", kind)
        if nbytes > LIMITS[kind]:
            raise ReceivedFileError(path, f"announces {nbytes} bytes of {kind}, more than the "
                                    f"{_size(LIMITS[kind])} epo reads", kind)
        return os.pread(fd, nbytes, 0), info.st_size
    except OSError as err:
        raise ReceivedFileError(path, f"cannot be read ({err.strerror or err})", kind) from None
    finally:
        os.close(fd)


def read_text(path: Path, kind: str, within: Path | None = None, errors: str = "strict") -> str:
    """read_bytes as UTF-8 text (`errors="replace"` for files read line by line, e.g. metrics.jsonl)."""
    data = read_bytes(path, kind, within)
    try:
        return data.decode("utf-8", errors=errors)
    except UnicodeDecodeError as err:
        raise ReceivedFileError(path, f"is not UTF-8 text (byte {err.start})", kind) from None


def json_depth(text: str) -> int:
    """How deep the arrays and objects of a JSON text nest (brackets inside strings do not count)."""
    if text.count("[") + text.count("{") <= MAX_JSON_DEPTH:
        return text.count("[") + text.count("{")  # an upper bound that is already small: no need to scan
    brackets = _BRACKETS_ONLY.sub("", _STRINGS.sub("", text))  # C-speed passes; then only brackets are walked
    return max(itertools.accumulate(1 if c in "[{" else -1 for c in brackets), default=0)


_STRINGS = re.compile(r'"(?:[^"\\]|\\.)*"')
_BRACKETS_ONLY = re.compile(r"[^\[\]{}]+")


def loads(text: str | bytes, **kwargs: Any) -> Any:
    """json.loads with the nesting cap: ValueError (json.JSONDecodeError's base) when it nests deeper than
    MAX_JSON_DEPTH, instead of a RecursionError deep inside json."""
    if isinstance(text, bytes):
        text = text.decode("utf-8")
    if json_depth(text) > MAX_JSON_DEPTH:
        raise ValueError(f"it nests arrays and objects more than {MAX_JSON_DEPTH} levels deep")
    return json.loads(text, **kwargs)


def model_folder_root(folder: Path) -> Path:
    """The folder a model folder's symlinks may point into: the folder itself, or for a Hugging Face cache
    snapshot (models--org--name/snapshots/<rev>/, whose files link to ../../blobs/) its repository folder."""
    folder = Path(folder)
    return folder.parent.parent if folder.parent.name == "snapshots" else folder


def read_json(path: Path, kind: str, within: Path | None = None, **kwargs: Any) -> Any:
    """A received JSON file, read with read_text and parsed with the nesting cap (`kwargs` go to json.loads).
    Not JSON at all is ReceivedFileError too (its reason says where)."""
    text = read_text(path, kind, within)
    try:
        return loads(text, **kwargs)
    except json.JSONDecodeError as err:
        raise ReceivedFileError(path, f"is not readable JSON ({err.msg} at line {err.lineno})", kind) from None
    except ValueError as err:
        raise ReceivedFileError(path, str(err).replace("it nests", "nests"), kind) from None
