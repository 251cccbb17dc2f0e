"""The artifact store: directories and files under one root, on local disk or in S3 (boto3).

`open_store(uri)` takes a local path, `file:///path` or `s3://bucket/prefix`; `LocalStore` and `S3Store` have
one interface. Paths are relative to the root (`"runs/<id>/checkpoints/step-000120"`) or full URIs of its kind.
The choices, each for a failure we do not want to debug later:

* **A reader never sees half a directory.** Locally, `put_dir` copies into a hidden sibling and renames it into
  place. In S3, where there is no rename, `manifest.json` is uploaded *last* (an old one deleted *first*), so a
  manifest is only ever visible over a complete upload; stale keys of an older upload are removed.
* **Downloads are verified** against the manifest's sha256s (the checkpoint format's one verifier,
  `trainer.checkpoint.verify_files`) in a staging directory, renamed into place only when whole.
* **Errors say what to do**: `StoreUnavailable` names the endpoint, `BucketNotFound` the bucket,
  `FileNotFoundError` the URI. `check()` asks the store once, with a short timeout, whether it can be used at
  all, so that a run whose store is down fails at its start, not after training at its checkpoint stage.
* **Standard AWS configuration, no credentials in sight.** boto3's own chain (`AWS_ACCESS_KEY_ID`, `AWS_PROFILE`,
  roles; `AWS_ENDPOINT_URL[_S3]` for MinIO/moto); retries, timeouts and multipart sizes in `S3Settings`; a store's
  repr shows its URI and endpoint only.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING
from urllib.parse import unquote, urlparse

from trainer.checkpoint import MANIFEST, CheckpointError, verify_files

if TYPE_CHECKING:  # boto3 loads on the first S3 call: a node that trains on local disk needs no boto3
    from boto3.s3.transfer import TransferConfig

# --- S3 client and calls ------------------------------------------------------------------------

MiB = 1024 * 1024
DELETE_BATCH = 1000  # the most keys one DeleteObjects request accepts


@dataclass(frozen=True)
class S3Settings:
    """How the client retries and times out, and when transfers go multipart."""

    # retries after the first attempt (botocore's Config "max_attempts"); AWS_MAX_ATTEMPTS, the AWS tools' setting
    # of all attempts, first included, is honoured when set (an explicit Config would otherwise override it)
    max_retries: int = field(default_factory=lambda: _aws_max_attempts() - 1)
    connect_timeout_s: float = 10.0
    read_timeout_s: float = 60.0
    multipart_threshold: int = 64 * MiB  # files at least this large are sent in parts
    multipart_chunksize: int = 16 * MiB  # part size; S3 requires >= 5 MiB for all parts but the last
    max_concurrency: int = 8  # parts in flight at once for one file
    check_retries: int = 1  # `check()` at the start of a run: a dead endpoint must fail it within seconds
    check_timeout_s: float = 5.0  # connect and read timeout of that check (worst case ~2 x 2 x 5 s + backoff)


def _aws_max_attempts(default: int = 5) -> int:
    """AWS_MAX_ATTEMPTS (all attempts, the first included) when set, else `default`."""
    given = os.environ.get("AWS_MAX_ATTEMPTS", "").strip()
    if not given:
        return default
    if not given.isdigit() or int(given) < 1:
        raise ValueError(
            f"AWS_MAX_ATTEMPTS={given!r}: not a whole number of attempts >= 1; set it to e.g. 5, or unset it"
        )
    return int(given)


def parse_s3_uri(uri: str) -> tuple[str, str]:
    """Split `s3://bucket/some/key` into `("bucket", "some/key")`; the key may be empty."""
    parsed = urlparse(uri)
    if parsed.scheme != "s3" or not parsed.netloc:
        raise ValueError(f"not an S3 URI: {uri!r}; expected the form s3://<bucket>/<key or prefix>")
    return parsed.netloc, parsed.path.lstrip("/")


def s3_client(
    endpoint_url: str | None = None,
    region: str | None = None,
    settings: S3Settings | None = None,
):
    """An S3 client from the standard AWS chain, with retries and timeouts from `settings`.

    `endpoint_url=None` lets boto3 take `AWS_ENDPOINT_URL_S3` / `AWS_ENDPOINT_URL` or the AWS
    default; `region=None` lets it take `AWS_DEFAULT_REGION` / `~/.aws/config`.
    """
    import boto3
    from botocore.config import Config

    settings = settings or S3Settings()
    config = Config(
        # In a Config, botocore's "max_attempts" counts retries, not the first attempt.
        retries={"max_attempts": settings.max_retries, "mode": "standard"},
        connect_timeout=settings.connect_timeout_s,
        read_timeout=settings.read_timeout_s,
    )
    # A session per client: boto3's default session is not safe to share between threads.
    session = boto3.session.Session()
    return session.client("s3", endpoint_url=endpoint_url, region_name=region, config=config)


def transfer_config(settings: S3Settings | None = None) -> TransferConfig:
    """The managed-transfer configuration: multipart threshold, part size, concurrency."""
    from boto3.s3.transfer import TransferConfig

    settings = settings or S3Settings()
    return TransferConfig(
        multipart_threshold=settings.multipart_threshold,
        multipart_chunksize=settings.multipart_chunksize,
        max_concurrency=settings.max_concurrency,
    )


def _upload_file(client, local_path: Path | str, bucket: str, key: str, transfer: TransferConfig | None = None) -> None:
    """Upload one file; multipart when it is above the transfer's threshold."""
    client.upload_file(str(local_path), bucket, key, Config=transfer or transfer_config())


def _download_file(
    client, bucket: str, key: str, local_path: Path | str, transfer: TransferConfig | None = None
) -> None:
    """Download one object to `local_path` (its parent must exist)."""
    client.download_file(bucket, key, str(local_path), Config=transfer or transfer_config())


def _list_keys(client, bucket: str, prefix: str) -> list[str]:
    """Every object key that starts with `prefix`, in S3's (lexicographic) order."""
    keys: list[str] = []
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        keys.extend(obj["Key"] for obj in page.get("Contents", []))
    return keys


def _list_subprefixes(client, bucket: str, prefix: str) -> list[str]:
    """The next level of "directories" under `prefix` (which should end in "/", or be "")."""
    found: list[str] = []
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix, Delimiter="/")
    for page in pages:
        found.extend(p["Prefix"] for p in page.get("CommonPrefixes", []))
    return found


def _delete_prefix(client, bucket: str, prefix: str) -> int:
    """Delete every object under `prefix`; returns how many. Refuses an empty prefix."""
    if not prefix:
        raise ValueError(f"refusing to delete every object in bucket {bucket!r}: give a non-empty prefix")
    keys = _list_keys(client, bucket, prefix)
    _delete_keys(client, bucket, keys)
    return len(keys)


def _delete_keys(client, bucket: str, keys: list[str]) -> None:
    """Delete these objects, up to 1000 per request; raises if S3 reports any it could not delete."""
    for start in range(0, len(keys), DELETE_BATCH):
        batch = keys[start : start + DELETE_BATCH]
        response = client.delete_objects(Bucket=bucket, Delete={"Objects": [{"Key": k} for k in batch], "Quiet": True})
        errors = response.get("Errors", [])
        if errors:
            first = errors[0]
            raise RuntimeError(
                f"could not delete {len(errors)} object(s) in s3://{bucket}, "
                f"e.g. {first.get('Key')!r}: {first.get('Code')} {first.get('Message')}"
            )


def _head(client, bucket: str, key: str) -> dict | None:
    """The object's metadata (HeadObject response), or None when there is no such object."""
    from botocore.exceptions import ClientError

    try:
        return client.head_object(Bucket=bucket, Key=key)
    except ClientError as err:
        if err.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
            return None
        raise


def _exists(client, bucket: str, key: str) -> bool:
    """Whether an object with exactly this key exists."""
    return _head(client, bucket, key) is not None


TMP_MARK = ".ballast-tmp-"  # names of staging / moved-aside directories; never listed


class ChecksumError(ValueError):
    """A downloaded artifact does not match its manifest: it is corrupt or incomplete."""


class StoreUnavailable(RuntimeError):
    """The object store's endpoint could not be reached, even after retries."""


class BucketNotFound(FileNotFoundError):
    """The S3 bucket named in a store URI does not exist at the endpoint."""


# --- manifest verification -------------------------------------------------------------------


def verify_manifest(local_dir: Path, source: str) -> None:
    """Check every file the manifest of `local_dir` names against its sha256 (nothing to check without one)."""
    manifest_path = local_dir / MANIFEST
    if not manifest_path.is_file():
        return
    try:
        manifest = json.loads(manifest_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ChecksumError(
            f"{MANIFEST} of {source} is not valid JSON ({err}); the artifact is corrupt or incomplete"
        ) from err
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict):
        return
    try:
        verify_files(local_dir, files, where=source)
    except CheckpointError as err:
        raise ChecksumError(f"{err} (the artifact is corrupt or incomplete)") from None


# --- local directory helpers -----------------------------------------------------------------


def _staging_path(target: Path) -> Path:
    """A hidden, unique sibling of `target`: same filesystem, so a rename is atomic."""
    return target.parent / f".{target.name}{TMP_MARK}{uuid.uuid4().hex[:8]}"


@contextlib.contextmanager
def _staged_file(target: Path):
    """A staging path to write `target`'s new content to: renamed onto `target` when the block ends, removed if
    the block fails, so a reader sees the old file or the whole new one, never a part."""
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = _staging_path(target)
    try:
        yield staging
        os.replace(staging, target)
    except BaseException:
        staging.unlink(missing_ok=True)
        raise


def _install(staged: Path, target: Path) -> None:
    """Rename `staged` into `target`, replacing an existing `target` (moved aside, then removed)."""
    if not (target.exists() or target.is_symlink()):
        os.replace(staged, target)
        return
    old = _staging_path(target)
    os.replace(target, old)
    try:
        os.replace(staged, target)
    except BaseException:
        os.replace(old, target)
        raise
    if old.is_dir() and not old.is_symlink():
        shutil.rmtree(old, ignore_errors=True)
    else:
        old.unlink(missing_ok=True)


def _files_under(local_dir: Path) -> list[Path]:
    return sorted(p for p in local_dir.rglob("*") if p.is_file())


def _require_dir(local_dir: Path) -> Path:
    local_dir = Path(local_dir)
    if not local_dir.is_dir():
        raise FileNotFoundError(f"cannot upload {local_dir}: it is not a directory")
    return local_dir


def _clean_relpath(path: str) -> str:
    """Normalise a store-relative path to "a/b/c"; refuse ".." so nothing escapes the root."""
    parts = [p for p in PurePosixPath(path.replace("\\", "/")).parts if p not in ("/", ".")]
    if ".." in parts:
        raise ValueError(f"path {path!r} leaves the store's root; use a path without '..'")
    return "/".join(parts)


# --- the interface ---------------------------------------------------------------------------


class ArtifactStore(ABC):
    """Directories and files under one root; see the module docstring for the guarantees."""

    @property
    @abstractmethod
    def uri(self) -> str:
        """The root of the store, as a URI `open_store` accepts."""

    @abstractmethod
    def child_uri(self, *parts: str) -> str:
        """The full URI of a path under the root."""

    @abstractmethod
    def put_dir(self, local_dir: Path, dest: str) -> str:
        """Upload every file of `local_dir` to `dest`, replacing what was there; returns its URI."""

    @abstractmethod
    def _download_tree(self, src: str, staging: Path) -> str:
        """Copy every file under `src` into the empty directory `staging`; returns src's URI."""

    @abstractmethod
    def list_dirs(self, prefix: str = "") -> list[str]:
        """Names of the immediate sub-directories under `prefix`, sorted."""

    @abstractmethod
    def exists(self, path: str) -> bool:
        """Whether a file or a non-empty directory exists at `path`."""

    @abstractmethod
    def delete_dir(self, path: str) -> None:
        """Delete the directory at `path` and everything under it; absent is not an error."""

    @abstractmethod
    def put_file(self, local: Path, dest: str) -> str:
        """Upload one file to `dest`; returns its URI."""

    @abstractmethod
    def _get_file_to(self, src: str, local: Path) -> None:
        """Download the file at `src` to `local` (whose parent exists)."""

    @abstractmethod
    def read_text(self, path: str) -> str:
        """The UTF-8 text of the file at `path`."""

    @abstractmethod
    def write_text(self, path: str, text: str) -> str:
        """Write `text` (UTF-8) to the file at `path`; returns its URI."""

    @abstractmethod
    def check(self) -> None:
        """Raise (StoreUnavailable, BucketNotFound, PermissionError) unless the store can be written now; fast."""

    def get_dir(self, src: str, local_dir: Path, verify: bool = True) -> Path:
        """Download the directory `src` to `local_dir`, verified against its manifest.

        The copy is staged in a temporary sibling of `local_dir` and renamed into place only when
        complete (and, with `verify`, matching every sha256 in `manifest.json`); on any error the
        staged copy is deleted and `local_dir` is left as it was.
        """
        local_dir = Path(local_dir)
        local_dir.parent.mkdir(parents=True, exist_ok=True)
        staging = _staging_path(local_dir)
        staging.mkdir()
        try:
            source = self._download_tree(src, staging)
            if verify:
                verify_manifest(staging, source)
            _install(staging, local_dir)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        return local_dir

    def get_file(self, src: str, local: Path) -> Path:
        """Download one file to `local`, written to a temporary name and renamed into place."""
        local = Path(local)
        with _staged_file(local) as staging:
            self._get_file_to(src, staging)
        return local

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.uri!r})"

    __str__ = __repr__


# --- local disk ------------------------------------------------------------------------------


class LocalStore(ArtifactStore):
    """A directory on this machine (or a shared filesystem)."""

    def __init__(self, root: Path | str):
        self.root = Path(root).expanduser().absolute()

    @property
    def uri(self) -> str:
        return str(self.root)

    def child_uri(self, *parts: str) -> str:
        return str(self._path("/".join(parts)))

    def _path(self, path: str) -> Path:
        if path.startswith("file://") or os.path.isabs(path):
            return _local_path(path)
        return self.root / _clean_relpath(path)

    def put_dir(self, local_dir: Path, dest: str) -> str:
        local_dir = _require_dir(local_dir)
        target = self._path(dest)
        if target == self.root:
            raise ValueError(f"put_dir needs a destination under {self.uri}, not the root itself")
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = _staging_path(target)
        try:
            shutil.copytree(local_dir, staging)
            _install(staging, target)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        return str(target)

    def _download_tree(self, src: str, staging: Path) -> str:
        source = self._path(src)
        if not source.is_dir():
            raise FileNotFoundError(f"no directory at {source}")
        shutil.copytree(source, staging, dirs_exist_ok=True)
        return str(source)

    def list_dirs(self, prefix: str = "") -> list[str]:
        base = self._path(prefix)
        if not base.is_dir():
            return []
        return sorted(p.name for p in base.iterdir() if p.is_dir() and TMP_MARK not in p.name)

    def exists(self, path: str) -> bool:
        return self._path(path).exists()

    def delete_dir(self, path: str) -> None:
        target = self._path(path)
        if target == self.root:
            raise ValueError(f"refusing to delete the whole store {self.uri}; name a directory in it")
        if target.is_dir():
            # Move aside first so a reader never sees a half-deleted directory.
            doomed = _staging_path(target)
            os.replace(target, doomed)
            shutil.rmtree(doomed)

    def put_file(self, local: Path, dest: str) -> str:
        target = self._path(dest)
        with _staged_file(target) as staging:
            shutil.copyfile(local, staging)
        return str(target)

    def _get_file_to(self, src: str, local: Path) -> None:
        source = self._path(src)
        if not source.is_file():
            raise FileNotFoundError(f"no file at {source}")
        shutil.copyfile(source, local)

    def read_text(self, path: str) -> str:
        source = self._path(path)
        if not source.is_file():
            raise FileNotFoundError(f"no file at {source}")
        return source.read_text(encoding="utf-8")

    def write_text(self, path: str, text: str) -> str:
        target = self._path(path)
        with _staged_file(target) as staging:
            staging.write_text(text, encoding="utf-8")
        return str(target)

    def check(self) -> None:
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise PermissionError(
                f"cannot create the artifact store directory {self.root} ({err.strerror}); "
                "fix storage.uri or the directory's permissions"
            ) from None
        if not os.access(self.root, os.W_OK):
            raise PermissionError(
                f"the artifact store directory {self.root} is not writable; fix storage.uri or "
                "the directory's permissions"
            )


# --- S3 --------------------------------------------------------------------------------------


class S3Store(ArtifactStore):
    """Objects under `s3://bucket/prefix`.

    The endpoint is `endpoint_url` if given, else `AWS_ENDPOINT_URL_S3` / `AWS_ENDPOINT_URL`, else
    AWS's. The bucket's existence is checked once, on first use, so that a wrong bucket name gives
    `BucketNotFound` rather than a bare 404.
    """

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        endpoint_url: str | None = None,
        region: str | None = None,
        settings: S3Settings | None = None,
    ):
        self.bucket = bucket
        self.prefix = _clean_relpath(prefix)
        self._settings = settings or S3Settings()
        self._client = s3_client(endpoint_url=endpoint_url, region=region, settings=self._settings)
        self._transfer = transfer_config(self._settings)
        self._bucket_checked = False

    @property
    def endpoint(self) -> str:
        return self._client.meta.endpoint_url

    @property
    def uri(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}".rstrip("/")

    def child_uri(self, *parts: str) -> str:
        bucket, key = self._locate("/".join(parts))
        return f"s3://{bucket}/{key}"

    def __repr__(self) -> str:
        return f"S3Store({self.uri!r}, endpoint={self.endpoint!r})"

    __str__ = __repr__

    # -- paths and errors

    def _locate(self, path: str) -> tuple[str, str]:
        """(bucket, key) of a store-relative path or a full s3:// URI."""
        if path.startswith("s3://"):
            bucket, key = parse_s3_uri(path)
            return bucket, _clean_relpath(key)
        if "://" in path:
            raise ValueError(f"{path!r} is not a path in {self.uri}; give a relative path or s3:// URI")
        return self.bucket, "/".join(p for p in (self.prefix, _clean_relpath(path)) if p)

    @contextlib.contextmanager
    def _errors(self, bucket: str):
        """Translate botocore's failures into errors that name the endpoint or bucket and the fix."""
        from boto3.exceptions import S3UploadFailedError
        from botocore.exceptions import ClientError, HTTPClientError, NoCredentialsError
        from botocore.exceptions import ConnectionError as BotoConnectionError

        try:
            if not self._bucket_checked:
                self._check_bucket(bucket)
            yield
        except (BotoConnectionError, HTTPClientError) as err:
            raise StoreUnavailable(
                f"cannot reach the S3 endpoint {self.endpoint} ({type(err).__name__}, "
                f"{self._settings.max_retries} retries); "
                "check AWS_ENDPOINT_URL / AWS_ENDPOINT_URL_S3 and that the network or object "
                "store is up"
            ) from err
        except NoCredentialsError as err:
            raise PermissionError(
                f"no AWS credentials found for {self.uri}; set AWS_ACCESS_KEY_ID and "
                "AWS_SECRET_ACCESS_KEY, or AWS_PROFILE / ~/.aws/credentials"
            ) from err
        except (ClientError, S3UploadFailedError) as err:
            if "NoSuchBucket" in str(err):
                raise self._no_bucket(bucket) from err
            raise

    def _check_bucket(self, bucket: str) -> None:
        from botocore.exceptions import ClientError

        try:
            self._client.head_bucket(Bucket=bucket)
        except ClientError as err:
            code = err.response.get("Error", {}).get("Code")
            if code in ("404", "NoSuchBucket", "NotFound"):
                raise self._no_bucket(bucket) from err
            if code not in ("403", "AccessDenied"):  # without ListBucket, find out on use
                raise
        self._bucket_checked = bucket == self.bucket

    def _no_bucket(self, bucket: str) -> BucketNotFound:
        return BucketNotFound(
            f"S3 bucket {bucket!r} does not exist at {self.endpoint}; create it "
            f"(aws s3 mb s3://{bucket}) or fix the bucket name in the storage URI"
        )

    def _missing(self, bucket: str, key: str) -> FileNotFoundError:
        return FileNotFoundError(f"nothing at s3://{bucket}/{key}")

    # -- directories

    def put_dir(self, local_dir: Path, dest: str) -> str:
        local_dir = _require_dir(local_dir)
        bucket, key = self._locate(dest)
        if not key:
            raise ValueError(f"put_dir needs a destination under {self.uri}, not the bucket root")
        files = _files_under(local_dir)
        relpaths = [p.relative_to(local_dir).as_posix() for p in files]
        new_keys = {f"{key}/{rel}" for rel in relpaths}
        manifest_key = f"{key}/{MANIFEST}"
        with self._errors(bucket):
            stale = [k for k in _list_keys(self._client, bucket, key + "/") if k not in new_keys]
            # Take down the old manifest first: readers must not pair it with new files.
            self._client.delete_object(Bucket=bucket, Key=manifest_key)
            for rel, path in zip(relpaths, files):
                if rel != MANIFEST:
                    _upload_file(self._client, path, bucket, f"{key}/{rel}", self._transfer)
            _delete_keys(self._client, bucket, stale)  # leftovers, gone before the manifest
            if MANIFEST in relpaths:
                manifest_path = local_dir / MANIFEST
                _upload_file(self._client, manifest_path, bucket, manifest_key, self._transfer)
        return f"s3://{bucket}/{key}"

    def _download_tree(self, src: str, staging: Path) -> str:
        bucket, key = self._locate(src)
        prefix = f"{key}/" if key else ""
        source = f"s3://{bucket}/{key}"
        with self._errors(bucket):
            keys = [k for k in _list_keys(self._client, bucket, prefix) if not k.endswith("/")]
            if not keys:
                raise self._missing(bucket, key)
            for k in keys:
                target = staging / _clean_relpath(k[len(prefix) :])
                target.parent.mkdir(parents=True, exist_ok=True)
                _download_file(self._client, bucket, k, target, self._transfer)
        return source

    def list_dirs(self, prefix: str = "") -> list[str]:
        bucket, key = self._locate(prefix)
        base = f"{key}/" if key else ""
        with self._errors(bucket):
            found = _list_subprefixes(self._client, bucket, base)
        return sorted(p[len(base) :].rstrip("/") for p in found)

    def exists(self, path: str) -> bool:
        bucket, key = self._locate(path)
        with self._errors(bucket):
            if key and _exists(self._client, bucket, key):
                return True
            page = self._client.list_objects_v2(Bucket=bucket, Prefix=f"{key}/" if key else "", MaxKeys=1)
        return page.get("KeyCount", 0) > 0

    def delete_dir(self, path: str) -> None:
        bucket, key = self._locate(path)
        if not key:
            raise ValueError(f"refusing to delete the whole store {self.uri}; name a directory in it")
        with self._errors(bucket):
            # The manifest first, so a reader never takes a half-deleted directory for a whole one.
            self._client.delete_object(Bucket=bucket, Key=f"{key}/{MANIFEST}")
            _delete_prefix(self._client, bucket, key + "/")

    # -- files

    def put_file(self, local: Path, dest: str) -> str:
        bucket, key = self._locate(dest)
        with self._errors(bucket):
            _upload_file(self._client, local, bucket, key, self._transfer)
        return f"s3://{bucket}/{key}"

    def _get_file_to(self, src: str, local: Path) -> None:
        bucket, key = self._locate(src)
        with self._errors(bucket):
            if not _exists(self._client, bucket, key):
                raise self._missing(bucket, key)
            _download_file(self._client, bucket, key, local, self._transfer)

    def read_text(self, path: str) -> str:
        from botocore.exceptions import ClientError

        bucket, key = self._locate(path)
        with self._errors(bucket):
            try:
                body = self._client.get_object(Bucket=bucket, Key=key)["Body"].read()
            except ClientError as err:
                if err.response.get("Error", {}).get("Code") in ("NoSuchKey", "404"):
                    raise self._missing(bucket, key) from err
                raise
        return body.decode("utf-8")

    def write_text(self, path: str, text: str) -> str:
        bucket, key = self._locate(path)
        with self._errors(bucket):
            self._client.put_object(Bucket=bucket, Key=key, Body=text.encode("utf-8"))
        return f"s3://{bucket}/{key}"

    def check(self) -> None:
        """HeadBucket through a client with `check_retries` and `check_timeout_s`, not the patient transfer client."""
        settings = self._settings
        impatient = S3Settings(
            max_retries=settings.check_retries,
            connect_timeout_s=settings.check_timeout_s,
            read_timeout_s=settings.check_timeout_s,
        )
        probe = S3Store(self.bucket, self.prefix, endpoint_url=self.endpoint, settings=impatient)
        with probe._errors(self.bucket):
            pass  # the first use checks the bucket (and so the endpoint and the credentials)
        self._bucket_checked = True


# --- opening and fetching --------------------------------------------------------------------


def _local_path(uri: str) -> Path:
    if uri.startswith("file://"):
        parsed = urlparse(uri)
        if parsed.netloc not in ("", "localhost"):
            raise ValueError(f"{uri!r} names a remote host; a file:// URI must be file:///abs/path")
        return Path(unquote(parsed.path))
    return Path(uri).expanduser().absolute()


def open_store(uri: str, *, endpoint_url: str | None = None, settings: S3Settings | None = None) -> ArtifactStore:
    """The store rooted at `uri`: a local path, `file:///path` or `s3://bucket/prefix`.

    `endpoint_url` and `settings` (retries, timeouts, multipart) apply to S3 only; by default the
    endpoint comes from `AWS_ENDPOINT_URL_S3` / `AWS_ENDPOINT_URL` or is AWS's.
    """
    uri = str(uri)
    if uri.startswith("s3://"):
        bucket, prefix = parse_s3_uri(uri)
        return S3Store(bucket, prefix, endpoint_url=endpoint_url, settings=settings)
    scheme = urlparse(uri).scheme
    if scheme not in ("", "file"):
        raise ValueError(
            f"unsupported artifact store URI {uri!r}: use a local path, file:///path or s3://bucket/prefix"
        )
    return LocalStore(_local_path(uri))


def _cache_path(cache_dir: Path, bucket: str, key: str) -> Path:
    """cache_dir/<bucket>/<key parts>, each part reduced to safe characters."""
    safe = [re.sub(r"[^A-Za-z0-9._=-]", "_", part) for part in [bucket, *key.split("/")] if part]
    return Path(cache_dir).joinpath(*(p if p not in (".", "..") else "_" for p in safe))


def fetch(
    uri: str,
    cache_dir: Path,
    *,
    verify: bool = True,
    endpoint_url: str | None = None,
    settings: S3Settings | None = None,
) -> Path:
    """A local directory holding the artifact at `uri`.

    A local path is returned as it is; an s3:// URI is downloaded (verified against its manifest unless the caller
    verifies it itself, `verify=False`) into `cache_dir/<bucket>/<key>`, replacing an older copy there.
    """
    uri = str(uri)
    if not uri.startswith("s3://"):
        path = _local_path(uri)
        if not path.is_dir():
            raise FileNotFoundError(
                f"artifact {uri} does not exist (no directory at {path}); check the path, or give "
                "the s3:// URI it was stored under"
            )
        return path
    bucket, key = parse_s3_uri(uri)
    store = S3Store(bucket, endpoint_url=endpoint_url, settings=settings)
    if not store.exists(key):
        raise FileNotFoundError(
            f"artifact {uri} does not exist at {store.endpoint}; check the URI (list the run with "
            f"`aws s3 ls s3://{bucket}/{key.rpartition('/')[0]}/`) and AWS_ENDPOINT_URL"
        )
    return store.get_dir(key, _cache_path(cache_dir, bucket, key), verify=verify)
