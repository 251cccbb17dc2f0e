"""pytest fixtures for tests that need S3: a real S3 API served by moto on localhost.

`tests/conftest.py` registers this module (`pytest_plugins = ["tests.s3_fixtures"]`), so every
test can ask for the fixtures by name:

* `moto_server` (session): starts `moto.server.ThreadedMotoServer` on 127.0.0.1 on a free port,
  points the standard AWS environment at it (AWS_ENDPOINT_URL, fake AWS_ACCESS_KEY_ID /
  AWS_SECRET_ACCESS_KEY, AWS_DEFAULT_REGION=us-east-1; AWS_PROFILE and AWS_ENDPOINT_URL_S3
  removed), yields the endpoint URL, and restores the environment afterwards. Anything built on
  boto3's default chain (`infra.store.s3_client()`, `infra.store.open_store("s3://...")`) talks to it
  with no further set-up.
* `s3_bucket` (function): a fresh, empty bucket with a unique name; emptied and deleted after the
  test.

A real server (rather than moto's in-process mock) is used so that what is tested is what runs:
HTTP, retries, multipart uploads, and code in other threads or processes.
"""

from __future__ import annotations

import socket
import uuid

import boto3
import pytest

TEST_REGION = "us-east-1"
TEST_CREDENTIAL = "testing"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="session")
def moto_server():
    """The endpoint URL of a moto S3 server; the AWS environment points at it for the session."""
    from moto.server import ThreadedMotoServer

    port = _free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    with pytest.MonkeyPatch.context() as env:
        env.setenv("AWS_ACCESS_KEY_ID", TEST_CREDENTIAL)
        env.setenv("AWS_SECRET_ACCESS_KEY", TEST_CREDENTIAL)
        env.setenv("AWS_DEFAULT_REGION", TEST_REGION)
        env.setenv("AWS_ENDPOINT_URL", endpoint)
        for name in ("AWS_SESSION_TOKEN", "AWS_PROFILE", "AWS_ENDPOINT_URL_S3"):
            env.delenv(name, raising=False)
        try:
            yield endpoint
        finally:
            server.stop()


@pytest.fixture(scope="session")
def _moto_admin_client(moto_server):
    """One client for creating and removing buckets (clients are safe to share; sessions are not)."""
    return boto3.session.Session().client("s3", endpoint_url=moto_server, region_name=TEST_REGION)


@pytest.fixture
def s3_bucket(_moto_admin_client):
    """The name of a new, empty bucket on the moto server; removed after the test."""
    client = _moto_admin_client
    name = f"ballast-test-{uuid.uuid4().hex[:12]}"
    client.create_bucket(Bucket=name)
    yield name
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=name):
        keys = [{"Key": obj["Key"]} for obj in page.get("Contents", [])]
        if keys:
            client.delete_objects(Bucket=name, Delete={"Objects": keys, "Quiet": True})
    client.delete_bucket(Bucket=name)
