"""`s3://bucket/prefix` model sources: every object under the prefix, downloaded into the cache with boto3.

Credentials, region and endpoint come from boto3's standard sources (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY
/ AWS_SESSION_TOKEN, AWS_PROFILE and the config files, AWS_REGION / AWS_DEFAULT_REGION, AWS_ENDPOINT_URL_S3 /
AWS_ENDPOINT_URL, container and instance roles), so any S3-compatible store works: AWS, R2, MinIO, RunPod's.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Mapping
from urllib.parse import urlsplit

import boto3
from boto3.s3.transfer import TransferConfig, create_transfer_manager
from botocore import UNSIGNED
from botocore.config import Config
from botocore.exceptions import (BotoCoreError, ClientError, ConnectionClosedError, CredentialRetrievalError,
                                 NoCredentialsError, PartialCredentialsError, ReadTimeoutError)
from botocore.exceptions import ConnectionError as BotoConnectionError
from s3transfer.exceptions import RetriesExceededError
from s3transfer.subscribers import BaseSubscriber

from engine.sources.base import ModelSourceError
from engine.sources.redaction import redact
from engine.sources.cache import RemoteFile, TransferProgress, entry_path, fetch_into_cache

log = logging.getLogger("engine.sources")

# At DEBUG botocore logs request headers, which carry the access key id and any session token.
for _name in ("botocore", "boto3", "s3transfer", "urllib3"):
    logging.getLogger(_name).setLevel(logging.INFO)

_MAX_CONCURRENCY = 16  # parallel ranged GETs across all files
_PART_BYTES = 8 * 2**20  # files above this are fetched in parts of this size
# A dead endpoint fails in seconds rather than botocore's default minutes (60 s connect timeout, 5 attempts).
_CLIENT_CONFIG = Config(connect_timeout=10, read_timeout=60, retries={"mode": "standard"},
                        max_pool_connections=_MAX_CONCURRENCY + 4)

_CLIENT_ERROR_CAUSES = {
    "NoSuchBucket": "the bucket does not exist",
    "AccessDenied": "access denied: the credentials may not list or read it (s3:ListBucket, s3:GetObject)",
    "AllAccessDisabled": "access to the bucket is disabled",
    "InvalidAccessKeyId": "the access key id is not known to this endpoint",
    "SignatureDoesNotMatch": "the secret access key does not match the access key id",
    "ExpiredToken": "the session token has expired",
    "InvalidToken": "the session token is invalid",
    "NoSuchKey": "an object listed a moment ago is gone (the prefix changed during the download)",
    "PreconditionFailed": "an object changed during the download",
}


def parse_uri(uri: str) -> tuple[str, str]:
    """(bucket, prefix) of `s3://bucket/prefix`; the prefix has no leading or trailing slash."""
    bucket, _, prefix = uri.removeprefix("s3://").partition("/")
    if not bucket:
        raise ModelSourceError(f"cannot load {uri}: no bucket name (expected s3://bucket/prefix)")
    return bucket, prefix.strip("/")


def fetch(uri: str, *, revision: str | None, cache_dir: Path, role: str) -> Path:
    """The local copy of the folder at `uri`, downloaded into the cache unless a complete copy is there.
    S3 has no revisions of a prefix: `revision` is a label that keys the cache entry (change it to fetch anew)."""
    bucket, prefix = parse_uri(uri)
    folder = None
    try:
        folder = _S3Folder(bucket, prefix)
        readable = f"{bucket}/{prefix}" + (f"@{revision}" if revision else "")
        target = entry_path(cache_dir, "s3", readable, [folder.endpoint, bucket, prefix, revision])
        return fetch_into_cache(target, source=folder.uri, revision=revision, role=role,
                                list_files=folder.list_files, download=folder.download)
    except ModelSourceError:
        raise
    except Exception as exc:  # boto3's errors, network and disk errors: one line naming the source and the cause
        # Messages of boto3 and the network quote the endpoint URL as configured, password and all.
        if folder is None:  # boto3 rejected its configuration (a malformed endpoint URL, say)
            raise ModelSourceError(redact(f"cannot download {uri}: {_cause(exc)}")) from None
        raise ModelSourceError(folder.redact(f"cannot download {folder.uri} from {folder.endpoint}: "
                                             f"{_cause(exc)}")) from None


class _S3Folder:
    def __init__(self, bucket: str, prefix: str):
        self.bucket = bucket
        self.prefix = prefix
        self.uri = f"s3://{bucket}/{prefix}".rstrip("/")
        self._key_prefix = f"{prefix}/" if prefix else ""
        self._session = boto3.session.Session()
        # An unsigned client resolves the endpoint exactly as the real one will, without looking up credentials
        # (which can mean a network call to an instance-metadata service): a cache hit needs no network at all.
        endpoint = urlsplit(self._session.client("s3", config=Config(signature_version=UNSIGNED)).meta.endpoint_url)
        self.endpoint = endpoint._replace(netloc=endpoint.netloc.rpartition("@")[2]).geturl()  # no user:password@
        self._client = None

    @property
    def client(self):
        if self._client is None:
            self._client = self._session.client("s3", config=_CLIENT_CONFIG)
        return self._client

    def list_files(self) -> dict[str, RemoteFile]:
        files = {}
        pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=self._key_prefix)
        for page in pages:
            for obj in page.get("Contents", []):
                key = obj["Key"]
                if key.endswith("/"):  # a folder marker some tools create; it holds no file
                    continue
                files[key[len(self._key_prefix):]] = RemoteFile(obj["Size"], obj.get("ETag", "").strip('"') or None)
        if not files:
            raise ModelSourceError(f"cannot download {self.uri}: no objects under prefix '{self._key_prefix}' in "
                                   f"bucket {self.bucket} (at {self.endpoint})")
        return files

    def download(self, scratch: Path, files: Mapping[str, RemoteFile], progress: TransferProgress) -> None:
        # The classic transfer manager on every machine (boto3 may pick its CRT one on some EC2 types): its
        # subscriber callbacks are what reports progress and passes the listing's sizes and ETags.
        config = TransferConfig(max_concurrency=_MAX_CONCURRENCY, multipart_threshold=_PART_BYTES,
                                multipart_chunksize=_PART_BYTES, preferred_transfer_client="classic")
        with create_transfer_manager(self.client, config) as manager:
            futures = []
            for name, remote in files.items():
                destination = scratch / name
                destination.parent.mkdir(parents=True, exist_ok=True)
                futures.append(manager.download(self.bucket, self._key_prefix + name, str(destination),
                                                subscribers=[_Progress(remote, progress)]))
            for future in futures:
                future.result()

    def redact(self, text: str) -> str:
        """`text` without URL passwords, the environment's secrets or the credentials in use (from a profile
        too)."""
        text = redact(text)
        # Only credentials a client has looked up can be in a message; asking for them here could mean a lookup.
        credentials = self._session.get_credentials() if self._client is not None else None
        if credentials is None:
            return text
        frozen = credentials.get_frozen_credentials()
        return redact(text, [s for s in (frozen.access_key, frozen.secret_key, frozen.token) if s])


class _Progress(BaseSubscriber):
    def __init__(self, remote: RemoteFile, progress: TransferProgress):
        self.remote = remote
        self.progress = progress

    def on_queued(self, future, **kwargs):
        # Known from the listing: saves a HEAD request per file, and the ETag makes every ranged GET of a
        # multipart download carry If-Match, so an object replaced mid-download fails instead of mixing versions.
        future.meta.provide_transfer_size(self.remote.size)
        if self.remote.etag:
            future.meta.provide_object_etag(f'"{self.remote.etag}"')

    def on_progress(self, future, bytes_transferred, **kwargs):
        self.progress.add(bytes_transferred)


def _cause(exc: BaseException) -> str:
    if isinstance(exc, (NoCredentialsError, PartialCredentialsError, CredentialRetrievalError)):
        return (f"no usable AWS credentials ({exc}); set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE, "
                f"or give the machine a role")
    if isinstance(exc, ClientError):
        error = exc.response.get("Error", {})
        code = error.get("Code") or ""
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        if code in _CLIENT_ERROR_CAUSES:
            return _CLIENT_ERROR_CAUSES[code]
        if status == 403:
            return _CLIENT_ERROR_CAUSES["AccessDenied"]
        return f"{code or status}: {error.get('Message') or exc}"
    if isinstance(exc, (BotoConnectionError, ConnectionClosedError, ReadTimeoutError, RetriesExceededError)):
        return f"network error: {exc}"
    if isinstance(exc, BotoCoreError):
        return str(exc)
    return f"{type(exc).__name__}: {exc}"
