"""A thin layer over boto3 for the S3 object store: a configured client and the few calls Ballast makes.

Choices:

* **Standard AWS configuration.** Credentials, region and endpoint come from boto3's own chain:
  `AWS_ACCESS_KEY_ID` / `AWS_SECRET_ACCESS_KEY` / `AWS_SESSION_TOKEN`, `AWS_PROFILE`, `~/.aws`,
  instance roles; `AWS_ENDPOINT_URL_S3` or `AWS_ENDPOINT_URL` point it at MinIO, Ceph or moto.
  An explicit `endpoint_url` argument wins over all of them. This module never reads, logs or
  prints a credential.
* **Retries and timeouts are set, not left to chance.** botocore's "standard" retry mode retries
  throttling and transient network errors with backoff; connect and read timeouts bound how long
  an unreachable endpoint can stall a run. Callers translate what is left (see `tasks/store.py`).
* **Multipart transfers** go through boto3's managed transfer (`TransferConfig`): a file above
  `multipart_threshold` is sent and fetched in `multipart_chunksize` parts, several at a time.
* All tuning lives in one place, `S3Settings`; the functions take a client so that one client
  (and its connection pool) serves a whole store.

Usage:

    client = s3_client()                       # endpoint from the environment or AWS default
    upload_file(client, "model.safetensors", "bucket", "runs/a/model.safetensors")
    list_keys(client, "bucket", "runs/a/")
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

import boto3
from boto3.s3.transfer import TransferConfig
from botocore.config import Config
from botocore.exceptions import ClientError

log = logging.getLogger(__name__)

MiB = 1024 * 1024
DELETE_BATCH = 1000  # the most keys one DeleteObjects request accepts


@dataclass(frozen=True)
class S3Settings:
    """How the client retries and times out, and when transfers go multipart."""

    max_retries: int = 4  # retries after the first attempt (botocore's Config "max_attempts")
    connect_timeout_s: float = 10.0
    read_timeout_s: float = 60.0
    multipart_threshold: int = 64 * MiB  # files at least this large are sent in parts
    multipart_chunksize: int = 16 * MiB  # part size; S3 requires >= 5 MiB for all parts but the last
    max_concurrency: int = 8  # parts in flight at once for one file


def parse_s3_uri(uri: str) -> tuple[str, str]:
    """Split `s3://bucket/some/key` into `("bucket", "some/key")`; the key may be empty."""
    parsed = urlparse(uri)
    if parsed.scheme != "s3" or not parsed.netloc:
        raise ValueError(
            f"not an S3 URI: {uri!r}; expected the form s3://<bucket>/<key or prefix>"
        )
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
    settings = settings or S3Settings()
    return TransferConfig(
        multipart_threshold=settings.multipart_threshold,
        multipart_chunksize=settings.multipart_chunksize,
        max_concurrency=settings.max_concurrency,
    )


def upload_file(client, local_path: Path | str, bucket: str, key: str,
                transfer: TransferConfig | None = None) -> None:
    """Upload one file; multipart when it is above the transfer's threshold."""
    log.debug("upload %s -> s3://%s/%s", local_path, bucket, key)
    client.upload_file(str(local_path), bucket, key, Config=transfer or transfer_config())


def download_file(client, bucket: str, key: str, local_path: Path | str,
                  transfer: TransferConfig | None = None) -> None:
    """Download one object to `local_path` (its parent must exist)."""
    log.debug("download s3://%s/%s -> %s", bucket, key, local_path)
    client.download_file(bucket, key, str(local_path), Config=transfer or transfer_config())


def list_keys(client, bucket: str, prefix: str) -> list[str]:
    """Every object key that starts with `prefix`, in S3's (lexicographic) order."""
    keys: list[str] = []
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        keys.extend(obj["Key"] for obj in page.get("Contents", []))
    return keys


def list_subprefixes(client, bucket: str, prefix: str) -> list[str]:
    """The next level of "directories" under `prefix` (which should end in "/", or be "")."""
    found: list[str] = []
    pages = client.get_paginator("list_objects_v2").paginate(
        Bucket=bucket, Prefix=prefix, Delimiter="/"
    )
    for page in pages:
        found.extend(p["Prefix"] for p in page.get("CommonPrefixes", []))
    return found


def delete_prefix(client, bucket: str, prefix: str) -> int:
    """Delete every object under `prefix`; returns how many. Refuses an empty prefix."""
    if not prefix:
        raise ValueError(
            f"refusing to delete every object in bucket {bucket!r}: give a non-empty prefix"
        )
    keys = list_keys(client, bucket, prefix)
    delete_keys(client, bucket, keys)
    log.debug("deleted %d objects under s3://%s/%s", len(keys), bucket, prefix)
    return len(keys)


def delete_keys(client, bucket: str, keys: list[str]) -> None:
    """Delete these objects, up to 1000 per request; raises if S3 reports any it could not delete."""
    for start in range(0, len(keys), DELETE_BATCH):
        batch = keys[start:start + DELETE_BATCH]
        response = client.delete_objects(
            Bucket=bucket, Delete={"Objects": [{"Key": k} for k in batch], "Quiet": True}
        )
        errors = response.get("Errors", [])
        if errors:
            first = errors[0]
            raise RuntimeError(
                f"could not delete {len(errors)} object(s) in s3://{bucket}, "
                f"e.g. {first.get('Key')!r}: {first.get('Code')} {first.get('Message')}"
            )


def head(client, bucket: str, key: str) -> dict | None:
    """The object's metadata (HeadObject response), or None when there is no such object."""
    try:
        return client.head_object(Bucket=bucket, Key=key)
    except ClientError as err:
        if err.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
            return None
        raise


def exists(client, bucket: str, key: str) -> bool:
    """Whether an object with exactly this key exists."""
    return head(client, bucket, key) is not None
