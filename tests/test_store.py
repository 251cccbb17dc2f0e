"""The artifact store (infra/store.py), on local disk and on S3 (a moto server): what goes in comes out, verified."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

from infra.store import (
    BucketNotFound,
    ChecksumError,
    LocalStore,
    S3Settings,
    S3Store,
    StoreUnavailable,
    fetch,
    open_store,
    parse_s3_uri,
    s3_client,
)

MiB = 1024 * 1024
# Small parts so that a 12 MiB file goes multipart (S3's smallest part is 5 MiB).
SMALL_PARTS = S3Settings(multipart_threshold=5 * MiB, multipart_chunksize=5 * MiB, max_concurrency=2)
# Give up on an unreachable endpoint at once: no retries, short timeouts.
IMPATIENT = S3Settings(max_retries=0, connect_timeout_s=1, read_timeout_s=1)


def make_checkpoint(root: Path, name: str = "step-000010", seed: int = 0, extra: dict | None = None) -> Path:
    """A fake checkpoint directory: adapter/, state/ and a manifest of sha256s."""
    files = {
        "adapter/adapter_model.safetensors": bytes([seed]) * 4096 + os.urandom(1024),
        "adapter/adapter_config.json": json.dumps({"r": 8, "seed": seed}).encode(),
        "state/optimizer.safetensors": os.urandom(2048),
        "state/trainer_state.json": json.dumps({"step": 10, "sampler_position": 40}).encode(),
        **(extra or {}),
    }
    ckpt = root / name
    for rel, data in files.items():
        (ckpt / rel).parent.mkdir(parents=True, exist_ok=True)
        (ckpt / rel).write_bytes(data)
    manifest = {"step": 10, "files": {rel: hashlib.sha256(d).hexdigest() for rel, d in files.items()}}
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    return ckpt


def tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(params=["local", "s3"])
def store(request, tmp_path):
    if request.param == "local":
        return open_store(str(tmp_path / "store"))
    bucket = request.getfixturevalue("s3_bucket")
    return open_store(f"s3://{bucket}/runs", settings=SMALL_PARTS)


@pytest.fixture
def checkpoint(tmp_path) -> Path:
    return make_checkpoint(tmp_path / "src")


# --- directories -----------------------------------------------------------------------------


def test_put_dir_then_get_dir_returns_every_file_unchanged(store, checkpoint, tmp_path):
    uri = store.put_dir(checkpoint, "run-1/step-000010")
    assert uri == store.child_uri("run-1", "step-000010")

    got = store.get_dir("run-1/step-000010", tmp_path / "dl" / "step-000010")

    assert got == tmp_path / "dl" / "step-000010"
    assert tree(got) == tree(checkpoint)
    assert os.listdir(tmp_path / "dl") == ["step-000010"]  # no staging directory left behind


def test_get_dir_accepts_the_full_uri(store, checkpoint, tmp_path):
    uri = store.put_dir(checkpoint, "run-1/step-000010")

    got = store.get_dir(uri, tmp_path / "dl")

    assert tree(got) == tree(checkpoint)


def test_tampered_file_raises_checksum_error_naming_it_and_leaves_no_local_copy(store, checkpoint, tmp_path):
    store.put_dir(checkpoint, "run-1/step-000010")
    tampered = tmp_path / "tampered"
    tampered.write_bytes(b"not the adapter")
    store.put_file(tampered, "run-1/step-000010/adapter/adapter_model.safetensors")
    (tmp_path / "dl").mkdir()

    with pytest.raises(ChecksumError) as err:
        store.get_dir("run-1/step-000010", tmp_path / "dl" / "step-000010")

    assert "adapter/adapter_model.safetensors" in str(err.value)
    assert "corrupt or incomplete" in str(err.value)
    assert os.listdir(tmp_path / "dl") == []


def test_file_listed_in_manifest_but_missing_raises_checksum_error(store, checkpoint, tmp_path):
    store.put_dir(checkpoint, "run-1/step-000010")
    store.delete_dir("run-1/step-000010/state")

    with pytest.raises(ChecksumError, match="state/optimizer.safetensors.*missing"):
        store.get_dir("run-1/step-000010", tmp_path / "dl")

    assert not (tmp_path / "dl").exists()


def test_get_dir_without_verify_accepts_a_mismatch(store, checkpoint, tmp_path):
    store.put_dir(checkpoint, "run-1/step-000010")
    store.write_text("run-1/step-000010/state/trainer_state.json", "{}")

    got = store.get_dir("run-1/step-000010", tmp_path / "dl", verify=False)

    assert (got / "state" / "trainer_state.json").read_text() == "{}"


def test_get_dir_of_a_missing_directory_raises_file_not_found(store, tmp_path):
    with pytest.raises(FileNotFoundError, match="run-1/step-000099"):
        store.get_dir("run-1/step-000099", tmp_path / "dl")

    assert not (tmp_path / "dl").exists()


def test_get_dir_replaces_an_existing_local_copy(store, checkpoint, tmp_path):
    store.put_dir(checkpoint, "run-1/step-000010")
    stale = tmp_path / "dl"
    stale.mkdir()
    (stale / "leftover.txt").write_text("old")

    got = store.get_dir("run-1/step-000010", stale)

    assert tree(got) == tree(checkpoint)


def test_list_dirs_returns_immediate_subdirectories_sorted(store, tmp_path):
    for run, step in [("run-1", "step-000020"), ("run-1", "step-000010"), ("run-2", "step-000005")]:
        store.put_dir(make_checkpoint(tmp_path / run, step), f"{run}/{step}")

    assert store.list_dirs("run-1") == ["step-000010", "step-000020"]
    assert store.list_dirs("") == ["run-1", "run-2"]
    assert store.list_dirs("run-1/step-000010") == ["adapter", "state"]
    assert store.list_dirs("no-such-run") == []


def test_delete_dir_removes_the_directory_and_only_it(store, tmp_path):
    for step in ["step-000010", "step-000020"]:
        store.put_dir(make_checkpoint(tmp_path, step), f"run-1/{step}")

    store.delete_dir("run-1/step-000010")

    assert not store.exists("run-1/step-000010")
    assert not store.exists("run-1/step-000010/manifest.json")
    assert store.list_dirs("run-1") == ["step-000020"]
    store.delete_dir("run-1/step-000010")  # deleting what is gone is not an error


def test_put_dir_over_an_existing_directory_replaces_it_entirely(store, tmp_path):
    first = make_checkpoint(tmp_path / "a", seed=1, extra={"state/only_in_first.bin": b"x"})
    second = make_checkpoint(tmp_path / "b", seed=2)
    store.put_dir(first, "run-1/step-000010")

    store.put_dir(second, "run-1/step-000010")

    got = store.get_dir("run-1/step-000010", tmp_path / "dl")
    assert tree(got) == tree(second)


def test_a_file_above_the_multipart_threshold_round_trips(store, tmp_path):
    big = tmp_path / "src" / "adapter" / "adapter_model.safetensors"
    big.parent.mkdir(parents=True)
    big.write_bytes(os.urandom(12 * MiB))

    store.put_dir(tmp_path / "src", "run-1/step-000010")
    got = store.get_dir("run-1/step-000010", tmp_path / "dl")

    assert tree(got) == tree(tmp_path / "src")
    if isinstance(store, S3Store):
        head = s3_client().head_object(
            Bucket=store.bucket, Key="runs/run-1/step-000010/adapter/adapter_model.safetensors"
        )
        assert head["ETag"].strip('"').endswith("-3")  # three 5 MiB parts: a multipart upload


# --- files -----------------------------------------------------------------------------------


def test_put_file_then_get_file_round_trips(store, tmp_path):
    src = tmp_path / "report.json"
    src.write_text('{"malformed": 0}')

    uri = store.put_file(src, "run-1/probe/report.json")
    got = store.get_file("run-1/probe/report.json", tmp_path / "dl" / "report.json")

    assert uri == store.child_uri("run-1/probe/report.json")
    assert got.read_text() == '{"malformed": 0}'
    assert store.exists("run-1/probe/report.json")
    assert store.exists("run-1/probe")


def test_write_text_then_read_text_round_trips(store):
    store.write_text("run-1/spec.yaml", "grpo:\n  beta: 0.04  # é\n")

    assert store.read_text("run-1/spec.yaml") == "grpo:\n  beta: 0.04  # é\n"


def test_reading_a_missing_file_raises_file_not_found(store, tmp_path):
    with pytest.raises(FileNotFoundError, match="run-1/nothing.txt"):
        store.read_text("run-1/nothing.txt")
    with pytest.raises(FileNotFoundError, match="run-1/nothing.txt"):
        store.get_file("run-1/nothing.txt", tmp_path / "nothing.txt")
    assert not store.exists("run-1/nothing.txt")


def test_paths_that_leave_the_root_are_refused(store, checkpoint):
    with pytest.raises(ValueError, match="leaves the store's root"):
        store.put_dir(checkpoint, "../elsewhere")


# --- opening, fetching, failures ---------------------------------------------------------------


def test_open_store_accepts_local_paths_file_uris_and_s3_uris(tmp_path):
    assert isinstance(open_store(str(tmp_path)), LocalStore)
    assert open_store(f"file://{tmp_path}").uri == str(tmp_path)
    s3_store = open_store("s3://bucket/some/prefix/")
    assert isinstance(s3_store, S3Store)
    assert s3_store.uri == "s3://bucket/some/prefix"
    assert s3_store.child_uri("run-1", "step-000010") == "s3://bucket/some/prefix/run-1/step-000010"


def test_open_store_rejects_an_unknown_scheme():
    with pytest.raises(ValueError, match="gs://bucket.*s3://bucket/prefix"):
        open_store("gs://bucket/prefix")


def test_parse_s3_uri_splits_bucket_and_key_and_rejects_other_uris():
    assert parse_s3_uri("s3://bucket/runs/run-1") == ("bucket", "runs/run-1")
    assert parse_s3_uri("s3://bucket") == ("bucket", "")
    with pytest.raises(ValueError, match="not an S3 URI: '/tmp/x'"):
        parse_s3_uri("/tmp/x")


def test_fetch_returns_a_local_directory_as_it_is(checkpoint, tmp_path):
    assert fetch(str(checkpoint), tmp_path / "cache") == checkpoint
    assert fetch(f"file://{checkpoint}", tmp_path / "cache") == checkpoint
    assert not (tmp_path / "cache").exists()


def test_fetch_downloads_an_s3_directory_into_the_cache(s3_bucket, checkpoint, tmp_path):
    uri = open_store(f"s3://{s3_bucket}/runs").put_dir(checkpoint, "run-1/step-000010")

    got = fetch(uri, tmp_path / "cache")

    assert got == tmp_path / "cache" / s3_bucket / "runs" / "run-1" / "step-000010"
    assert tree(got) == tree(checkpoint)
    assert fetch(uri, tmp_path / "cache") == got  # a second fetch replaces the copy


@pytest.mark.parametrize("where", ["local", "s3"])
def test_fetch_of_a_missing_artifact_names_the_uri(where, request, tmp_path):
    if where == "local":
        uri = str(tmp_path / "no-such-step")
    else:
        uri = f"s3://{request.getfixturevalue('s3_bucket')}/runs/no-such-step"

    with pytest.raises(FileNotFoundError, match=f"artifact {uri} does not exist"):
        fetch(uri, tmp_path / "cache")


def _point_aws_at(monkeypatch, endpoint: str | None, key_id: str = "testing", secret: str = "testing"):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", key_id)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
    if endpoint:
        monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)


@pytest.mark.parametrize("via", ["environment", "argument"])
def test_unreachable_endpoint_raises_store_unavailable_naming_it(via, monkeypatch, checkpoint):
    _point_aws_at(monkeypatch, "http://127.0.0.1:1" if via == "environment" else None)
    endpoint_url = "http://127.0.0.1:1" if via == "argument" else None
    store = open_store("s3://bucket/runs", endpoint_url=endpoint_url, settings=IMPATIENT)

    with pytest.raises(StoreUnavailable, match=r"http://127\.0\.0\.1:1 .*AWS_ENDPOINT_URL"):
        store.put_dir(checkpoint, "run-1/step-000010")
    with pytest.raises(StoreUnavailable):
        store.list_dirs("")


def test_aws_max_attempts_sets_the_retries_and_a_bad_value_is_named(monkeypatch, checkpoint):
    """AWS_MAX_ATTEMPTS, the AWS tools' count of all attempts, is honoured (Ballast's explicit botocore Config would
    otherwise override it): 2 attempts are 1 retry, said in the error; a value that is no count is refused naming it."""
    _point_aws_at(monkeypatch, "http://127.0.0.1:1")
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "2")
    assert S3Settings().max_retries == 1
    assert s3_client(settings=S3Settings()).meta.config.retries["total_max_attempts"] == 2
    store = open_store("s3://bucket/runs", settings=S3Settings(connect_timeout_s=1, read_timeout_s=1))
    with pytest.raises(StoreUnavailable, match=r"\(EndpointConnectionError, 1 retries\)"):
        store.list_dirs("")
    monkeypatch.delenv("AWS_MAX_ATTEMPTS")
    assert S3Settings().max_retries == 4
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "many")
    with pytest.raises(ValueError, match=r"^AWS_MAX_ATTEMPTS='many': not a whole number of attempts >= 1; set it"):
        S3Settings()


def test_missing_bucket_raises_bucket_not_found_naming_it(moto_server, checkpoint):
    store = open_store("s3://ballast-no-such-bucket/runs")

    with pytest.raises(BucketNotFound, match="'ballast-no-such-bucket' does not exist"):
        store.put_dir(checkpoint, "run-1/step-000010")


def test_credentials_never_appear_in_the_store_or_its_errors(moto_server, monkeypatch, checkpoint):
    _point_aws_at(monkeypatch, moto_server, key_id="AKIDBALLASTKEYID", secret="ballast-secret-key")
    shown = [repr(open_store("s3://bucket/runs")), str(open_store("s3://bucket/runs"))]
    with pytest.raises(StoreUnavailable) as err:
        open_store("s3://bucket/runs", endpoint_url="http://127.0.0.1:1", settings=IMPATIENT).list_dirs("")
    shown.append(str(err.value))

    for text in shown:
        assert "AKIDBALLASTKEYID" not in text
        assert "ballast-secret-key" not in text
    assert shown[0] == f"S3Store('s3://bucket/runs', endpoint='{moto_server}')"
