"""Input files in an object store, read through pyarrow's filesystems (no other
client library): ``s3://bucket/c4/*.json.gz``.

:data:`SCHEMES` is what a source path may start with. pyarrow finds the
credentials and options where each service's own tools do: for S3 the
``AWS_*`` variables (``AWS_ENDPOINT_URL`` for an S3-compatible store such as
MinIO), ``~/.aws`` or the machine's role; for Google Cloud Storage the
application default credentials. Every process that reads (a pool or Ray
worker on another node too) needs them.

A :class:`RemotePath` stands where ingest has a local :class:`~pathlib.Path`:
the same ``name``, ``suffix``, ``stat()`` (size and modification time, which
the resume fingerprint and a worker's same-file check compare) and
``is_file()``; :func:`open_stream` and :func:`open_file` give its bytes. It
has no ``__fspath__``, so that nothing opens it as a local file by mistake.
"""

from __future__ import annotations

import fnmatch
import re
import stat
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import Any

import pyarrow as pa
import pyarrow.fs as pafs

from pipeline.config import SecretValueError
from pipeline.files import URL_SCHEME, refuse_url

# scheme -> what it names (pyarrow.fs.FileSystem.from_uri reads each; a path in
# either is "bucket/key")
SCHEMES: dict[str, str] = {
    "s3": "Amazon S3 or an S3-compatible store",
    "gs": "Google Cloud Storage",
    "gcs": "Google Cloud Storage",
}

GLOB_MAGIC = re.compile(r"[*?[]")
BUCKET_NAME = re.compile(r"[A-Za-z0-9._-]+")  # S3's and GCS's bucket names, upper case too (MinIO's)

_FILESYSTEMS: dict[str, Any] = {}  # "s3://bucket" -> its pyarrow filesystem, one per process
_LISTINGS_AT_ONCE = 16  # folders of one glob level listed concurrently


def scheme_of(path: str) -> str | None:
    """The scheme of a URL (``s3``), or None for a local path."""
    match = URL_SCHEME.match(path)
    return match.group(0)[:-len("://")].lower() if match else None


def check_url(path: str) -> str:
    """``path`` as a source's params give it, checked before any work: a URL
    must be of a store of :data:`SCHEMES` (:func:`~pipeline.files.refuse_url`)
    and name a bucket, and no URL may carry credentials (``s3://key:secret@``),
    which would be written to the logs, to MLflow's params and to every
    document's source; the message does not repeat them."""
    match = URL_SCHEME.match(path)
    if match is None:
        return path
    authority = path[match.end():].partition("/")[0]
    if "@" in authority:
        raise SecretValueError(
            f"a URL with credentials in it ({match.group(0)}…@{authority.rpartition('@')[2]}), which would be "
            "written to the logs, to MLflow and to every document's source; remove them and give them the store's "
            "own way (for S3 the AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY variables, ~/.aws or the machine's "
            "role; for GCS the application default credentials)")
    refuse_url(path, readable=SCHEMES)
    if not BUCKET_NAME.fullmatch(authority):
        what = (f"{authority!r} is not a bucket name (letters, digits, '.', '-' and '_'; no wildcard or port)"
                if authority else "no bucket name")
        raise ValueError(f"{match.group(0)} and then {what}: write {match.group(0)}<bucket>/<key or glob>")
    if "//" in path[match.end():]:
        raise ValueError("an empty folder name ('//'), which pyarrow cannot read in a store: write one '/'")
    return path


def _split(uri: str) -> tuple[str, str]:
    """``s3://bucket/a/b`` -> (``s3://bucket``, ``a/b``)."""
    scheme, rest = uri.split("://", 1)
    authority, _, key = rest.partition("/")
    return f"{scheme.lower()}://{authority}", key


def filesystem(uri: str) -> tuple[Any, str]:
    """The pyarrow filesystem that holds ``uri`` (made once per process and
    bucket: for S3, ``from_uri`` asks the bucket's region) and the path in it."""
    root, key = _split(uri)
    if root not in _FILESYSTEMS:
        _FILESYSTEMS[root] = pafs.FileSystem.from_uri(root)[0]
    return _FILESYSTEMS[root], f"{root.split('://', 1)[1]}/{key}".rstrip("/")


def _found(root: str, info: Any) -> "RemotePath":
    """The file the filesystem of ``root`` (``s3://bucket``) listed as ``info``."""
    return RemotePath(f"{root}/{info.path.split('/', 1)[1]}", info.size, info.mtime_ns or 0)


@dataclass(frozen=True)
class RemotePath:
    """A file (or folder) named by a URL; ``str()`` is the URL. A path that a
    listing found carries the size and modification time it gave, which
    ``stat()`` and ``is_file()`` then answer without asking the store again
    (the stage asks several things of every input); :meth:`restat` asks."""
    uri: str
    size: int | None = field(default=None, compare=False)
    mtime_ns: int | None = field(default=None, compare=False)

    def __str__(self) -> str:
        return self.uri

    @property
    def name(self) -> str:
        return PurePosixPath(_split(self.uri)[1]).name

    @property
    def suffix(self) -> str:
        return PurePosixPath(self.name).suffix

    def hidden_below(self, root: "RemotePath") -> bool:
        """Whether a part of this path below ``root`` (of all of it where it is
        not below) starts with a dot, as glob and a folder walk leave out."""
        mine, theirs = self.uri.rstrip("/"), root.uri.rstrip("/") + "/"
        rest = mine[len(theirs):] if mine.startswith(theirs) else _split(mine)[1]
        return any(part.startswith(".") for part in PurePosixPath(rest).parts)

    def _info(self) -> Any:
        fs, path = filesystem(self.uri)
        return fs.get_file_info(path)

    def _listed(self) -> bool:
        return self.size is not None

    def restat(self) -> "RemoteStat":
        """Size and modification time as the store has them now (the store's
        time, to the second for S3)."""
        info = self._info()
        if info.type == pafs.FileType.NotFound:
            raise FileNotFoundError(f"{self.uri} does not exist")
        mode = stat.S_IFREG if info.type == pafs.FileType.File else stat.S_IFDIR
        return _stat_result(mode, info.size or 0, info.mtime_ns or 0)

    def stat(self) -> "RemoteStat":
        if self._listed():
            return _stat_result(stat.S_IFREG, self.size, self.mtime_ns)
        return self.restat()

    def is_file(self) -> bool:
        return self._listed() or self._info().type == pafs.FileType.File

    def is_dir(self) -> bool:
        return not self._listed() and self._info().type == pafs.FileType.Directory

    def exists(self) -> bool:
        return self._listed() or self._info().type != pafs.FileType.NotFound

    def is_symlink(self) -> bool:
        return False

    def resolve(self) -> "RemotePath":
        return self


@dataclass(frozen=True)
class RemoteStat:
    """What ``stat()`` tells of a remote file: what :class:`os.stat_result`
    tells of a local one that the stages read."""
    st_mode: int
    st_size: int
    st_mtime_ns: int

    @property
    def st_mtime(self) -> float:
        return self.st_mtime_ns / 1e9


def _stat_result(mode: int, size: int, mtime_ns: int) -> RemoteStat:
    """A stat of a remote file, its time to the whole second: S3 lists objects'
    times to the millisecond but HEAD gives them to the second, and a worker's
    check compares the stage's listing with its own HEAD."""
    return RemoteStat(mode, size, mtime_ns // 10**9 * 10**9)


def open_stream(path: RemotePath) -> Any:
    """The bytes of ``path``, read front to back (a pyarrow input stream)."""
    fs, key = filesystem(path.uri)
    return fs.open_input_stream(key)


def open_file(path: RemotePath) -> Any:
    """``path`` opened for random access (Parquet's footer and row groups)."""
    fs, key = filesystem(path.uri)
    return fs.open_input_file(key)


def _glob_matches(pattern: list[str], parts: list[str]) -> bool:
    """Whether a key's ``parts`` match a glob's ``pattern`` parts as
    ``glob.glob(recursive=True)`` matches a path's: each part by
    :func:`fnmatch.fnmatchcase` (``*``, ``?`` and ``[a-z]`` stay within a part),
    and ``**`` as a whole part any number of parts (at least one where it ends
    the pattern: a file below the folder)."""
    if not pattern:
        return not parts
    if pattern[0] == "**":
        if len(pattern) == 1:
            return bool(parts)
        return _glob_matches(pattern[1:], parts) or (bool(parts) and _glob_matches(pattern, parts[1:]))
    return bool(parts) and fnmatch.fnmatchcase(parts[0], pattern[0]) and _glob_matches(pattern[1:], parts[1:])


def listed(uri: str, where: str, error: type[Exception]) -> tuple[RemotePath, list[RemotePath]]:
    """:func:`list_files` for a stage's source (``where``: its params key):
    nothing there, or a store that cannot be listed (no network, no
    credentials, after pyarrow's own retries), is one line, an ``error``."""
    try:
        found = list_files(uri)
    except (OSError, pa.ArrowInvalid) as e:  # ArrowInvalid: a key pyarrow cannot take
        raise error(f"{where}: cannot list {uri!r}: {e}".replace("\n", " ")) from None
    if found is None:
        raise error(f"{where}: no such file or folder: {uri!r}")
    return found


def list_files(uri: str) -> tuple[RemotePath, list[RemotePath]] | None:
    """What a source URL names, as (the folder the user named, its files,
    sorted): a file, every file below a folder, or the files a glob matches
    (see :func:`_glob_candidates`). None where nothing is at a URL without a
    wildcard."""
    root, key = _split(uri)
    if magic := GLOB_MAGIC.search(key):
        prefix = key[:magic.start()].rpartition("/")[0]
        base = RemotePath(f"{root}/{prefix}".rstrip("/"))
        fs, base_path = filesystem(base.uri)
        parts = key[len(prefix):].lstrip("/").split("/")
        found = [_found(root, i) for i in _glob_candidates(fs, base_path, parts)]
        return base, sorted((f for f in found if _glob_matches(key.split("/"), _split(f.uri)[1].split("/"))),
                            key=str)
    fs, path = filesystem(uri)
    info = fs.get_file_info(path)
    if info.type == pafs.FileType.File:
        return RemotePath(f"{root}/{key.rpartition('/')[0]}".rstrip("/")), [_found(root, info)]
    if info.type == pafs.FileType.Directory:
        listed = fs.get_file_info(pafs.FileSelector(path, recursive=True))
        return RemotePath(uri.rstrip("/")), sorted((_found(root, i) for i in listed
                                                    if i.type == pafs.FileType.File), key=str)
    return None


def _glob_candidates(fs: Any, base: str, parts: list[str]) -> list[Any]:
    """The files below the folder ``base`` that the glob ``parts`` (the
    pattern's parts below ``base``) may match: one folder level at a time, as
    deep as the pattern goes, listing only the folders whose names match (a
    store lists a folder's names without the keys below them); from a ``**``
    on, everything below. So ``s3://bucket/*/train.jsonl`` lists the bucket's
    top-level names, then asks for one name in each, not for every key in
    the bucket. The requests of a level run concurrently."""
    def listing(folder: str, recursive: bool = False) -> list[Any]:
        return fs.get_file_info(pafs.FileSelector(folder, recursive=recursive, allow_not_found=True))

    def named(folders: list[str], part: str, kind: Any) -> list[Any]:
        """What each of ``folders`` holds of type ``kind`` whose name matches ``part``."""
        return [f for listed in pool.map(listing, folders) for f in listed
                if f.type == kind and fnmatch.fnmatchcase(f.base_name, part)]

    deep = parts.index("**") if "**" in parts else len(parts) - 1  # the last part, or the first **
    folders = [base]
    with ThreadPoolExecutor(max_workers=_LISTINGS_AT_ONCE) as pool:
        for part in parts[:deep]:  # a name is not listed: the folder is just extended
            folders = ([f"{d}/{part}" for d in folders] if not GLOB_MAGIC.search(part)
                       else [f.path for f in named(folders, part, pafs.FileType.Directory)])
        last = parts[deep]
        if last == "**":
            found = [f for listed in pool.map(lambda d: listing(d, recursive=True), folders) for f in listed]
        elif not GLOB_MAGIC.search(last):  # one request each for what is there
            found = list(pool.map(fs.get_file_info, [f"{d}/{last}" for d in folders]))
        else:
            found = named(folders, last, pafs.FileType.File)
    return [f for f in found if f.type == pafs.FileType.File]
