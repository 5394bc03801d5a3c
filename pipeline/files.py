"""Small file helpers that are honest about state.

Anything that must survive a crash goes through :func:`atomic_write` (or
:func:`atomic_path` for writers that want a filename, :func:`atomic_dir` for a
whole folder): it is written to a temporary name in the same directory, fsynced,
renamed over the target, and the directory is fsynced, so a reader sees the old
file or the new one and never half of either. A write that fails because its
filesystem is full (or the user's quota is) raises :class:`DiskFullError`, a
one-line StageError that names the path and the space left, whatever the
writer raised (torch.save and safetensors do not pass the OS's errno on).

:func:`available_cores` is the one count of the cores this process may use, and
:func:`die_with_parent` the one way a child process is tied to its parent's life.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import re
import shutil
import signal
import sys
import tempfile
from pathlib import Path
from typing import IO, Any, Iterable, Iterator

from pipeline.errors import StageError

log = logging.getLogger("pipeline.files")

# Less than this left on a filesystem after a write into it failed: the write
# failed for want of space, whatever the writer raised.
LOW_SPACE_BYTES = 1 << 20
_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)


# The name prefix of the folder an atomic_dir swap moves out of the way: between
# the swap's two renames it is the only copy of what the path held.
SWAPPED_OUT = ".old-"

# What a URL starts with: s3://, gs://, hf://, https://, file://
URL_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]+://")


def refuse_url(path: str, readable: Iterable[str] = ()) -> str:
    """``path``, unless it is a URL of a scheme not in ``readable``: the stages
    read their inputs through this machine's filesystem (and from the object
    stores ``readable`` names), so another URL is refused with how to get its
    files there, rather than matching no files."""
    match = URL_SCHEME.match(path)
    if match and match.group(0)[:-3].lower() not in readable:
        stores = f"and from {', '.join(s + '://' for s in readable)}; " if readable else ""
        raise ValueError(f"a URL ({match.group(0)}), but inputs are read from this machine's filesystem ({stores}"
                         "see the README's Ingest sources): mount the storage at the same path on every node (an "
                         "object store with mountpoint-s3, gcsfuse or blobfuse2) or copy the files here, and give "
                         "that path")
    return path


class DiskFullError(StageError):
    """A write failed because its filesystem is full or the user's quota is."""


class DamagedFileError(StageError, ValueError):
    """A JSON file a stage wrote (a manifest, a report, metrics) does not parse: cut
    short or edited. A ValueError too, as json's own error, for callers that skip such a file."""


def _existing(path: str | Path) -> Path:
    """``path``, or its nearest folder that exists, absolute and with links resolved."""
    p = Path(path).resolve()
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def free_bytes(path: str | Path) -> int | None:
    """The bytes this user may still write on the filesystem of ``path`` (its
    nearest existing folder), or None where the OS cannot say."""
    try:
        return shutil.disk_usage(_existing(path)).free
    except OSError:
        return None


def mount_point(path: str | Path) -> Path:
    """The mount point of the filesystem that holds ``path``."""
    p = _existing(path)
    while not os.path.ismount(p) and p != p.parent:
        p = p.parent
    return p


def size_text(n: int) -> str:
    """``n`` bytes for a message: 3.2 GB, 41.0 MB, 512 kB."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6)):
        if n >= scale:
            return f"{n / scale:,.1f} {unit}"
    return f"{n / 1e3:,.0f} kB"


def out_of_space(err: BaseException, path: str | Path | None = None) -> bool:
    """Whether ``err`` is a write that failed for want of space: an ENOSPC or
    EDQUOT anywhere in its chain of causes, or, where ``path`` names what was
    being written, less than ``LOW_SPACE_BYTES`` left on its filesystem (ask
    before the failed write's files are removed)."""
    if isinstance(err, DiskFullError):
        return True
    if isinstance(err, StageError):  # a stage's own error says what went wrong
        return False
    if any(isinstance(e, OSError) and e.errno in _FULL_ERRNOS for e in _causes(err)):
        return True
    free = free_bytes(path) if path is not None else None
    return free is not None and free < LOW_SPACE_BYTES


def no_space(path: str | Path | None) -> DiskFullError:
    """The one-line error for a write to ``path`` that did not fit, with the
    space free there now."""
    if path is None:
        return DiskFullError("no space left on the device; free some space and run the stage again")
    free = free_bytes(path)
    left = f" ({size_text(free)} free on {mount_point(path)})" if free is not None else ""
    return DiskFullError(f"no space left on the device writing {path}{left}; free some space and run the "
                         "stage again")


def disk_full(err: BaseException) -> DiskFullError | None:
    """A :class:`DiskFullError` for ``err`` if it is a write that failed for want
    of space (an ENOSPC or EDQUOT among its causes; it names the file the OS
    named), else None."""
    if isinstance(err, DiskFullError):
        return err
    if not out_of_space(err):
        return None
    named = [e.filename for e in _causes(err) if isinstance(e, OSError) and e.filename]
    return no_space(named[0] if named else None)


_REFUSED_ERRNOS = (errno.EACCES, errno.EPERM, errno.EROFS)


def expected_failure(err: BaseException) -> StageError | None:
    """``err`` as the one-line error a runner prints: a StageError as it is, or,
    where the OS refused a file operation for a reason the user fixes outside
    the code, no space (:func:`disk_full`), or a permission or a read-only
    filesystem on a path it names; else None (a bug keeps its traceback)."""
    if isinstance(err, StageError):
        return err
    if (full := disk_full(err)) is not None:
        return full
    for e in _causes(err):
        if isinstance(e, OSError) and e.errno in _REFUSED_ERRNOS and e.filename:
            what = (e.strerror or os.strerror(e.errno)).lower()
            return StageError(f"{what}: {e.filename} ({errno.errorcode[e.errno]})")
    return None


def _causes(err: BaseException) -> Iterator[BaseException]:
    """``err`` and the exceptions it was raised from or while handling, in turn."""
    seen: set[int] = set()
    cause: BaseException | None = err
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        yield cause
        cause = cause.__cause__ or cause.__context__


def fsync_path(path: str | Path) -> None:
    """fsync a file or a directory (a directory's fsync makes renames in it durable)."""
    fd = os.open(str(path), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_write(path: str | Path, mode: str = "w", encoding: str | None = "utf-8") -> Iterator[IO]:
    """Open a temporary file beside ``path``; on clean exit fsync it and rename it
    over ``path``. On error the temporary file is removed and ``path`` is untouched."""
    binary = "b" in mode
    with atomic_path(path) as tmp, open(tmp, mode, encoding=None if binary else encoding) as f:
        yield f


def current_umask() -> int:
    """This process's umask (reading it means setting it: set back at once)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


@contextlib.contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """Yield a temporary path beside ``path`` for writers that want a filename
    (pyarrow, safetensors); it is fsynced and renamed over ``path`` on success."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        yield Path(tmp)
        # mkstemp (and safetensors, writing anew) make the file owner-only: give it
        # the mode open() would, by the umask, as every other file the stages write
        os.chmod(tmp, 0o666 & ~current_umask())
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
        fsync_path(path.parent)
    except BaseException as err:
        full = isinstance(err, Exception) and out_of_space(err, path)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        if full:
            raise (err if isinstance(err, DiskFullError) else no_space(path)) from err
        raise


@contextlib.contextmanager
def atomic_dir(path: str | Path) -> Iterator[Path]:
    """Yield an empty folder beside ``path`` (``.tmp-<name>-<pid>``) to fill; on
    clean exit fsync every file in it and the folder, then swap it in for ``path``
    by rename. On error the temporary folder is removed and ``path`` is untouched.

    The swap is two renames (old folder to ``.old-<name>-<pid>``, new folder to
    ``path``); a crash between them leaves no ``path`` but the old folder whole
    under that name, and the next call (or :func:`restore_swapped_out`) moves it
    back before anything else. Other leftovers of interrupted runs beside
    ``path`` are removed first.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    restore_swapped_out(path)
    for pattern in (f".tmp-{path.name}-*", f"{SWAPPED_OUT}{path.name}-*", f".trash-{path.name}-*"):
        for leftover in path.parent.glob(pattern):
            shutil.rmtree(leftover, ignore_errors=True)
    tmp = path.parent / f".tmp-{path.name}-{os.getpid()}"
    trash = path.parent / f"{SWAPPED_OUT}{path.name}-{os.getpid()}"
    tmp.mkdir()
    try:
        yield tmp
        mode = 0o666 & ~current_umask()
        for p in sorted(tmp.rglob("*"), reverse=True):  # files before the folders holding them
            if p.is_file() and not p.is_symlink():
                os.chmod(p, mode)  # as open() would make it: safetensors makes its files owner-only
            fsync_path(p)
        fsync_path(tmp)
        if path.is_dir() and not path.is_symlink():
            os.replace(path, trash)
        elif path.exists() or path.is_symlink():
            path.unlink()
        os.replace(tmp, path)
        fsync_path(path.parent)
    except BaseException as err:
        full = isinstance(err, Exception) and out_of_space(err, path)
        shutil.rmtree(tmp, ignore_errors=True)
        if full:
            raise (err if isinstance(err, DiskFullError) else no_space(path)) from err
        raise
    shutil.rmtree(trash, ignore_errors=True)


def restore_swapped_out(path: str | Path) -> Path | None:
    """If an :func:`atomic_dir` swap into ``path`` was cut between its two renames
    (a kill, a power cut), ``path`` is missing and the folder it held lies whole
    beside it as ``.old-<name>-<pid>``: move that back to ``path`` with a warning,
    and return it. Nothing a user made is lost to a kill at that moment."""
    path = Path(path)
    if path.exists() or path.is_symlink():
        return None  # the swap completed: a copy beside it is superseded
    olds = sorted((p for p in path.parent.glob(f"{SWAPPED_OUT}{path.name}-*")
                   if re.fullmatch(rf"{re.escape(SWAPPED_OUT + path.name)}-\d+", p.name) and p.is_dir()
                   and not p.is_symlink()), key=lambda p: p.stat().st_mtime)
    if not olds:
        return None
    os.replace(olds[-1], path)
    fsync_path(path.parent)
    log.warning("%s was missing: an earlier replacement of it was interrupted; its previous contents, kept "
                "as %s, are back in place", path, olds[-1].name)
    return path


def available_cores() -> int:
    """The cores this process may run on: its CPU affinity where the OS has one
    (a container or ``taskset`` limit), else the machine's count."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def die_with_parent(sig: int = signal.SIGKILL, parent_pid: int | None = None) -> None:
    """Ask the kernel to send ``sig`` to this process when its parent exits
    (Linux; elsewhere a no-op), so that no child outlives the process that
    watches it: a torchrun rank its agent (torchrun starts ranks in a new
    session, so killing the launcher's process group would orphan them), a data
    worker its stage, even when that is SIGKILLed (an interrupted ``dvc repro``).
    ``parent_pid`` is the parent as the caller knew it (default: the current
    one); if it is already gone, this process gets ``sig`` at once."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    parent = os.getppid() if parent_pid is None else parent_pid
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, sig)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the parent died before prctl took effect
        os.kill(os.getpid(), sig)


def write_json(path: str | Path, data: Any) -> None:
    with atomic_write(path) as f:
        json.dump(data, f, indent=2, sort_keys=False, default=json_default)
        f.write("\n")


def read_json(path: str | Path) -> Any:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def read_stage_json(path: str | Path) -> Any:
    """The JSON value of a file a stage wrote (a manifest, a report, metrics) for
    the next one; a one-line DamagedFileError naming it when it does not parse."""
    try:
        return read_json(path)
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
        raise DamagedFileError(f"{path} is damaged: not valid JSON ({e}); run the stage that writes it again") from None


def json_default(obj: Any) -> Any:
    # numpy scalars and Paths show up in metrics; keep them readable.
    if hasattr(obj, "item"):
        return obj.item()
    if isinstance(obj, Path):
        return str(obj)
    raise TypeError(f"not JSON serialisable: {type(obj).__name__}")


def source_digest() -> str:
    """A sha256 (16 hex digits) of the source files of the ``pipeline`` package
    this process imported: two processes with the same digest run the same code."""
    root = Path(sys.modules["pipeline"].__file__).parent
    h = hashlib.sha256()
    for f in sorted(root.rglob("*.py")):
        h.update(f.relative_to(root).as_posix().encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def sha256_file(path: str | Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def broken_links(folder: str | Path) -> str | None:
    """A one-line description of the entries of ``folder`` that are symbolic links
    to nothing, None when there are none (or ``folder`` is not a folder).

    The typical cause: a snapshot folder of the Hugging Face cache copied with
    ``cp -r``, whose files are relative links into the cache's ``blobs/``; in the
    copy they point nowhere, and the folder would read as having no weights."""
    folder = Path(folder)
    if not folder.is_dir():
        return None
    broken = sorted(p for p in folder.iterdir() if p.is_symlink() and not p.exists())
    if not broken:
        return None
    first = broken[0]
    return (f"{', '.join(p.name for p in broken)} {'is a link' if len(broken) == 1 else 'are links'} to nothing "
            f"({first.name} -> {os.readlink(first)}): a copy of a Hugging Face cache snapshot keeps its relative "
            "links; copy it with `cp -rL` (following links) or download it with --local-dir")
