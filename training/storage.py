"""Every path mixerlab reads or writes goes through here: a local path, or an object-storage URL (``gs://``,
``s3://``, or any other fsspec protocol).

Local paths behave exactly as plain ``os``/``open`` calls (relative paths stay relative to the working
directory). URLs go through fsspec: ``gs://`` needs ``gcsfs``, ``s3://`` needs ``s3fs`` (both in the
``mixerlab[cloud]`` extra). S3-compatible servers are reached through the standard ``AWS_ENDPOINT_URL``
environment variable, which botocore reads itself.

Object stores have no append, no rename and no local file handle, so code that needs one of those works on a
local *staging* copy (``Staging``): files are written locally, then uploaded whole (``push``); a failed upload
keeps the local copy and says where it is. Files that a library can only read from disk are downloaded into a
per-URL cache directory first (``local_copy``).

Errors are ``StorageError`` naming the config key and the URL: a missing extra, missing credentials, a
missing bucket, nothing matching a glob.
"""
from __future__ import annotations

import hashlib
import os
import re
import shutil
import sys
import tempfile
from contextlib import contextmanager
from typing import Iterator

_URL = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.\-]*)://")
# The package that implements each object-storage protocol, for the "install this" message.
PROTOCOL_PACKAGES = {"gs": "gcsfs", "gcs": "gcsfs", "s3": "s3fs", "s3a": "s3fs"}
CLOUD_EXTRA = 'pip install "mixerlab[cloud]"'
CACHE_ENV = "MIXERLAB_STORAGE_CACHE"  # where downloaded copies live (default: a folder in the temp dir)


class StorageError(OSError):
    """A path or URL cannot be used; the message names the config key, the URL and what to do."""


# ------------------------------------------------------------------------------------------------ names
def is_url(path) -> bool:
    """Whether ``path`` names object storage (``scheme://...``); ``file://`` URLs count as local."""
    m = _URL.match(str(path))
    return bool(m) and m.group(1).lower() != "file"


def protocol(path: str) -> str:
    """``gs``, ``s3``, ... for a URL; ``file`` for a local path."""
    return _URL.match(path).group(1).lower() if is_url(path) else "file"


def _local(path: str) -> str:
    return path[len("file://"):] if str(path).startswith("file://") else str(path)


def absolute(path: str) -> str:
    """A URL unchanged (without a trailing slash); a local path made absolute (``~`` expanded)."""
    if is_url(path):
        return path.rstrip("/") if not path.endswith("://") else path
    return os.path.abspath(os.path.expanduser(_local(path)))


def join(base: str, *parts: str) -> str:
    """``os.path.join`` for local paths; '/'-joined for URLs (os.path would squash ``gs://`` to ``gs:/``)."""
    if not is_url(base):
        return os.path.join(_local(base), *parts)
    out = base.rstrip("/")
    for p in parts:
        out += "/" + str(p).strip("/")
    return out


def basename(path: str) -> str:
    return path.rstrip("/").rsplit("/", 1)[-1] if is_url(path) else os.path.basename(path)


def dirname(path: str) -> str:
    if not is_url(path):
        return os.path.dirname(path)
    head = path.rstrip("/").rsplit("/", 1)[0]
    return head if "://" in head and not head.endswith(":/") else path


def has_glob(path: str) -> bool:
    return any(ch in path for ch in "*?[")


# ------------------------------------------------------------------------------------------------ errors
def bucket(url: str) -> str:
    """``proto://bucket`` of a URL."""
    rest = url.split("://", 1)[1]
    return f"{protocol(url)}://{rest.split('/', 1)[0]}"


def _credentials_hint(url: str) -> str:
    if protocol(url) in ("gs", "gcs"):
        return ("run `gcloud auth application-default login`, or on a TPU VM give its service account access to "
                "the bucket, or set GOOGLE_APPLICATION_CREDENTIALS to a key file")
    if protocol(url) in ("s3", "s3a"):
        return ("set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY (or AWS_PROFILE), and AWS_ENDPOINT_URL for an "
                "S3-compatible server")
    return "check the credentials of this filesystem"


def _is_credentials_error(e: BaseException) -> bool:
    names = {type(x).__name__ for x in _chain(e)}
    text = " ".join(str(x) for x in _chain(e)).lower()
    return bool(names & {"NoCredentialsError", "PartialCredentialsError", "DefaultCredentialsError",
                         "RefreshError", "InvalidAccessKeyId", "SignatureDoesNotMatch"}) \
        or "could not find default credentials" in text or "invalidaccesskeyid" in text \
        or "signaturedoesnotmatch" in text or "unable to locate credentials" in text


def _is_permission_error(e: BaseException) -> bool:
    return any(isinstance(x, PermissionError) for x in _chain(e)) or any(
        s in str(x) for x in _chain(e) for s in ("AccessDenied", "403 Forbidden", "does not have storage."))


def _chain(e: BaseException):
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        yield e
        e = e.__cause__ or e.__context__


def describe(e: BaseException, path: str, key: str) -> StorageError:
    """The one-line StorageError for an exception raised while using ``path`` (named by config ``key``)."""
    if isinstance(e, StorageError):
        return e
    what = f"{key}: {path}" if key else path
    if is_url(path):
        if _is_credentials_error(e):
            return StorageError(f"{what}: no usable credentials for {bucket(path)} ({_short(e)}); "
                                f"{_credentials_hint(path)}")
        if _is_permission_error(e):
            return StorageError(f"{what}: permission denied on {bucket(path)} ({_short(e)}); give the account in "
                                f"use read/write access to the bucket, or {_credentials_hint(path)}")
        if any(isinstance(x, FileNotFoundError) for x in _chain(e)) and not _bucket_exists(path):
            return StorageError(f"{what}: the bucket {bucket(path)} does not exist (or is not visible with these "
                                f"credentials); create it or fix the URL")
    if isinstance(e, FileNotFoundError):
        return StorageError(f"{what}: does not exist")
    return StorageError(f"{what}: {_short(e)}")


def _short(e: BaseException, limit: int = 200) -> str:
    text = " ".join(str(e).split())
    text = text[:limit] + " ..." if len(text) > limit else text
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def _bucket_exists(url: str) -> bool:
    try:
        fs = filesystem(url)
        return bool(fs.exists(fs._strip_protocol(bucket(url))))
    except Exception:  # noqa: BLE001 - while explaining one error, another one must not replace it
        return True  # unknown: do not claim the bucket is missing


@contextmanager
def errors(path: str, key: str = "") -> Iterator[None]:
    """Re-raises any exception of the block as a StorageError naming ``key`` and ``path`` (URLs only: local
    errors keep their type, as before this module existed)."""
    try:
        yield
    except StorageError:
        raise
    except Exception as e:
        if not is_url(path):
            raise
        raise describe(e, path, key) from e


# ------------------------------------------------------------------------------------------------ filesystems
def filesystem(path: str, key: str = ""):
    """The fsspec filesystem of ``path``; StorageError naming the extra to install when its package is missing."""
    import fsspec

    proto = protocol(path)
    try:
        return fsspec.filesystem(proto)
    except (ImportError, ValueError) as e:
        package = PROTOCOL_PACKAGES.get(proto)
        what = f"{key}: {path}" if key else path
        if package is not None and isinstance(e, ImportError):
            raise StorageError(f"{what}: {proto}:// URLs need the {package} package; install it with "
                               f"{CLOUD_EXTRA} (or pip install {package})") from None
        raise StorageError(f"{what}: no filesystem for {proto}:// ({_short(e)}); use a local path, gs:// or "
                           f"s3://") from None


def _fs_path(path: str, key: str = ""):
    fs = filesystem(path, key)
    return fs, (fs._strip_protocol(path) if is_url(path) else _local(path))


def _url(path: str, fs_path: str) -> str:
    """A path returned by fsspec (no protocol) as a URL of the same protocol as ``path``."""
    return f"{protocol(path)}://{fs_path.lstrip('/')}" if is_url(path) else fs_path


def _test(name: str, path: str, key: str) -> bool:
    """``os.path.<name>`` for a local path, ``fs.<name>`` for a URL (exists / isdir / isfile)."""
    if not is_url(path):
        return getattr(os.path, name)(_local(path))
    with errors(path, key):
        fs, p = _fs_path(path, key)
        return bool(getattr(fs, name)(p))


def exists(path: str, key: str = "") -> bool:
    return _test("exists", path, key)


def isdir(path: str, key: str = "") -> bool:
    return _test("isdir", path, key)


def isfile(path: str, key: str = "") -> bool:
    return _test("isfile", path, key)


def refresh(path: str) -> None:
    """Forgets fsspec's cached listings around ``path`` (URLs), so that the next call sees other writers."""
    if is_url(path):
        fs, p = _fs_path(path)
        fs.invalidate_cache(p)


def listdir(path: str, key: str = "") -> list[str]:
    """Names (not paths) of the entries of a directory; FileNotFoundError (local) or StorageError (URL)."""
    if not is_url(path):
        return os.listdir(_local(path))
    with errors(path, key):
        fs, p = _fs_path(path, key)
        fs.invalidate_cache(p)
        return [e.rstrip("/").rsplit("/", 1)[-1] for e in fs.ls(p, detail=False) if e.rstrip("/") != p.rstrip("/")]


def glob(pattern: str, key: str = "") -> list[str]:
    """Sorted paths (URLs for a URL pattern) matching ``pattern`` (``**`` recurses)."""
    if not is_url(pattern):
        import glob as _glob

        return sorted(_glob.glob(os.path.expanduser(_local(pattern)), recursive=True))
    with errors(pattern, key):
        fs, p = _fs_path(pattern, key)
        return sorted(_url(pattern, m) for m in fs.glob(p))


def makedirs(path: str, key: str = "") -> None:
    if not is_url(path):
        os.makedirs(_local(path), exist_ok=True)
        return
    # Object stores have no folders, and fsspec's makedirs would create a missing *bucket*: nothing to do.


def open_file(path: str, mode: str = "rb", key: str = "", **kwargs):
    """A file object (``with`` it). Remote files are read with range requests, so a Parquet row group costs
    one read of its own bytes, not a download of the file."""
    if not is_url(path):
        return open(_local(path), mode, **kwargs)
    with errors(path, key):
        fs, p = _fs_path(path, key)
        return fs.open(p, mode, **kwargs)


def read_text(path: str, key: str = "") -> str:
    with errors(path, key):
        with open_file(path, "r", encoding="utf-8") as f:
            return f.read()


def write_text(path: str, text: str, key: str = "") -> None:
    """Writes the whole file; a reader never sees half of it (local: temp file + rename; object stores publish
    an object only when its upload completes)."""
    if not is_url(path):
        tmp = _local(path) + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, _local(path))
        return
    with errors(path, key):
        fs, p = _fs_path(path, key)
        fs.pipe_file(p, text.encode("utf-8"))


def remove(path: str, key: str = "") -> None:
    """Deletes a file or a directory tree (missing: no error)."""
    if not is_url(path):
        p = _local(path)
        if os.path.isdir(p):
            shutil.rmtree(p, ignore_errors=True)
        elif os.path.exists(p):
            os.remove(p)
        return
    with errors(path, key):
        fs, p = _fs_path(path, key)
        if fs.exists(p):
            fs.rm(p, recursive=True)


def move(src: str, dst: str, key: str = "") -> None:
    """Renames a file or directory (object stores: copy, then delete the source)."""
    if not is_url(src):
        os.rename(_local(src), _local(dst))
        return
    with errors(src, key):
        fs, p = _fs_path(src, key)
        move_objects(fs, p, fs._strip_protocol(dst))


def move_objects(fs, src: str, dst: str) -> None:
    """Moves the object ``src``, or every object under the prefix ``src`` (a pseudo-folder), to ``dst``: copy
    each object, then delete the originals. fsspec's ``mv(recursive=True)`` on a pseudo-folder (S3, GCS) copies
    the objects and then raises FileNotFoundError for the folder itself, which has no object of its own."""
    fs.invalidate_cache(src)
    if not fs.isdir(src):
        fs.copy(src, dst)
        fs.rm(src)
        return
    base = src.rstrip("/")
    files = [f for f in fs.find(base) if f.rstrip("/") != base]
    for f in files:
        fs.copy(f, dst.rstrip("/") + "/" + f[len(base) + 1:])
    if files:
        fs.rm(files)
    fs.invalidate_cache(base)
    try:  # a folder marker object (written by some tools), if any
        if fs.exists(base):
            fs.rm(base, recursive=True)
    except FileNotFoundError:
        pass


def sizes(directory: str, key: str = "") -> dict[str, dict]:
    """``{relative path: {"size": bytes, "checksum": the store's own checksum or None}}`` of every file under
    ``directory``, from one listing (nothing is downloaded). The checksum is GCS's crc32c or S3's ETag."""
    with errors(directory, key):
        fs, p = _fs_path(directory, key)
        if is_url(directory):
            fs.invalidate_cache(p)
        out = {}
        for name, info in fs.find(p, detail=True).items():
            if info.get("type") == "directory":
                continue
            rel = name[len(p.rstrip("/")) + 1:]
            checksum = info.get("crc32c") or info.get("ETag") or info.get("etag")
            out[rel] = {"size": int(info["size"]), "checksum": str(checksum).strip('"') if checksum else None}
        return out


def upload(local: str, url: str, key: str = "") -> None:
    """Copies a local file or directory tree to ``url`` (file by file, the tree's own layout)."""
    with errors(url, key):
        fs, p = _fs_path(url, key)
        if os.path.isdir(local):
            files = sorted(os.path.join(r, n) for r, _, names in os.walk(local) for n in names)
            for f in files:
                fs.put_file(f, p.rstrip("/") + "/" + os.path.relpath(f, local).replace(os.sep, "/"))
        else:
            fs.put_file(local, p)


def download(url: str, local: str, key: str = "") -> None:
    """Copies ``url`` (a file or a directory tree) to the local path ``local``."""
    with errors(url, key):
        fs, p = _fs_path(url, key)
        if fs.isdir(p):
            os.makedirs(local, exist_ok=True)
            for name in fs.find(p):
                rel = name[len(p.rstrip("/")) + 1:]
                target = os.path.join(local, *rel.split("/"))
                os.makedirs(os.path.dirname(target), exist_ok=True)
                fs.get_file(name, target)
        else:
            os.makedirs(os.path.dirname(os.path.abspath(local)), exist_ok=True)
            fs.get_file(p, local)


# ------------------------------------------------------------------------------------------------ local copies
def cache_dir() -> str:
    return os.environ.get(CACHE_ENV) or os.path.join(tempfile.gettempdir(), "mixerlab-storage-cache")


def local_copy(path: str, key: str = "") -> str:
    """A local path with the contents of ``path``: local paths as they are; a URL is downloaded (once per URL and
    size) into ``cache_dir()``. For libraries that only open local files (tokenizers)."""
    if not is_url(path):
        return _local(path)
    with errors(path, key):
        fs, p = _fs_path(path, key)
        info = fs.info(p)
        tag = hashlib.sha256(f"{path}\0{info.get('size')}\0{info.get('ETag') or info.get('crc32c')}".encode())
        target = os.path.join(cache_dir(), tag.hexdigest()[:16], basename(path))
        if not os.path.exists(target):
            os.makedirs(os.path.dirname(target), exist_ok=True)
            tmp = f"{target}.part-{os.getpid()}"
            fs.get_file(p, tmp)
            os.replace(tmp, target)  # several processes may download at once: each publishes a whole file
        return target


# ------------------------------------------------------------------------------------------------ staging folders
STAGING_KINDS = ("checkpoints", "staging")
UPLOAD_FAILED = "UPLOAD-FAILED.txt"  # written into a staging folder whose upload failed: it holds the only copy
_STAGING_NAME = re.compile(r"^mixerlab-(?:" + "|".join(STAGING_KINDS) + r")-(\d+)-")


def staging_prefix(kind: str) -> str:
    """``mkdtemp`` prefix of a staging folder: ``mixerlab-<kind>-<pid>-``; the pid tells a live owner from a
    killed one (``remove_stale_staging``)."""
    return f"mixerlab-{kind}-{os.getpid()}-"


def process_alive(pid: int) -> bool:
    """Whether ``pid`` is a live process of this host (a zombie counts as gone)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def remove_stale_staging(directory: str | None = None) -> list[str]:
    """Deletes the staging folders (``mixerlab-checkpoints-<pid>-*``, ``mixerlab-staging-<pid>-*``) of processes
    that are gone (a killed run never cleans up), except those holding a failed upload (``UPLOAD_FAILED``:
    their message named them as the only copy). Returns the folders deleted."""
    directory = directory or tempfile.gettempdir()
    removed = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        m = _STAGING_NAME.match(name)
        path = os.path.join(directory, name)
        if not m or int(m.group(1)) == os.getpid() or process_alive(int(m.group(1))):
            continue
        if not os.path.isdir(path) or os.path.exists(os.path.join(path, UPLOAD_FAILED)):
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def mark_upload_failed(folder: str, message: str) -> None:
    """Marks a staging folder as holding the only copy of something (kept by ``remove_stale_staging``)."""
    try:
        with open(os.path.join(folder, UPLOAD_FAILED), "a", encoding="utf-8") as f:
            f.write(message + "\n")
    except OSError:
        pass


class Staging:
    """A local working copy of a run-directory entry kept at ``url``.

    Local ``url``: ``path(name)`` is the file itself and ``push``/``pull`` do nothing. URL: ``path(name)`` is in a
    temporary directory; ``pull`` downloads what the bucket holds (to append to it), ``push`` uploads the local
    copy whole. A failed push raises StorageError naming the local copy, which is left in place so that nothing
    written is lost.
    """

    def __init__(self, url: str, key: str = "train.output_dir"):
        self.url, self.key = url, key
        self.remote = is_url(url)
        if self.remote:
            remove_stale_staging()
        self.root = tempfile.mkdtemp(prefix=staging_prefix("staging")) if self.remote else _local(url)
        self.failed: list[str] = []  # messages of pushes that failed (their local copies are kept)

    def path(self, name: str) -> str:
        return os.path.join(self.root, name)

    def remote_path(self, name: str) -> str:
        return join(self.url, name)

    def pull(self, name: str) -> bool:
        """Downloads ``name`` when the bucket has it; returns whether it did."""
        if not self.remote or not exists(self.remote_path(name), self.key):
            return False
        download(self.remote_path(name), self.path(name), self.key)
        return True

    def push(self, name: str, *, strict: bool = True) -> None:
        """Uploads ``name``. A failure raises StorageError (``strict``) or, for clean-up paths that must not hide
        the error that brought them there, prints a warning; either way the local copy stays."""
        if not self.remote or not os.path.exists(self.path(name)):
            return
        try:
            upload(self.path(name), self.remote_path(name), self.key)
        except StorageError as e:
            message = f"{e}; the local copy is kept at {self.path(name)}"
            self.failed.append(message)
            mark_upload_failed(self.root, message)
            if strict:
                raise StorageError(message) from e
            print(f"warning: {message}", file=sys.stderr, flush=True)

    def cleanup(self) -> None:
        """Deletes the local copies, unless an upload failed (then they are the only copy)."""
        if self.remote and not self.failed:
            shutil.rmtree(self.root, ignore_errors=True)


@contextmanager
def local_output(path: str, key: str = "") -> Iterator[str]:
    """A local path to write ``path`` through (for libraries that only write local files: matplotlib, ...):
    ``path`` itself when local; else a temporary file uploaded when the block ends without an error. A failed
    upload raises StorageError naming the temporary file, which is then kept."""
    if not is_url(path):
        parent = os.path.dirname(os.path.abspath(_local(path)))
        os.makedirs(parent, exist_ok=True)
        yield _local(path)
        return
    tmp_dir = tempfile.mkdtemp(prefix="mixerlab-output-")
    local = os.path.join(tmp_dir, basename(path))
    yield local
    try:
        upload(local, path, key)
    except StorageError as e:
        raise StorageError(f"{e}; the file is kept at {local}") from e
    shutil.rmtree(tmp_dir, ignore_errors=True)
