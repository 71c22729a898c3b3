"""Model sources: S3 through moto (in-process `mock_aws`, and a real `ThreadedMotoServer` reached through
AWS_ENDPOINT_URL_S3), the download cache, baked models, the Hugging Face Hub without a network, local paths.

The model is a small random Llama built here and uploaded as real files; the worker loads it through MODEL_NAME
and generates from it, and its greedy output must match the same model loaded from the local folder.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import boto3
import pytest
import requests
from moto import mock_aws
from moto.server import ThreadedMotoServer

from conftest import ROOT, free_port
from engine.sources import store as model_store
from engine.config import EngineConfig
from engine.sources.base import ModelSourceError, building
from engine.sources.cache import MANIFEST_NAME, manifest_intact
from network_fixtures import TcpProxy, upload_folder
from tiny_models import build_small_model

BUCKET = "models"
URI = f"s3://{BUCKET}/small"
ACCESS_KEY = "AKIAMODELSOURCETEST1"
SECRET_KEY = "model-source-test-secret-key-do-not-log"
SESSION_TOKEN = "model-source-test-session-token-do-not-log"
COMPLETION = {"prompt": "The capital of France is", "max_tokens": 12, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def small_model(tmp_path_factory) -> Path:
    return build_small_model(tmp_path_factory.mktemp("small-model"))


@pytest.fixture(scope="module")
def local_completion(small_model) -> dict:
    """The greedy completion of the small model loaded from its local folder: what every source must give."""
    return run_jobs(EngineConfig(model=str(small_model)), {"openai_route": "/v1/completions",
                                                           "openai_input": COMPLETION})[0]


@pytest.fixture
def aws_env(monkeypatch, tmp_path):
    """Test credentials, and none of the AWS configuration of the machine running the tests."""
    for name in list(os.environ):
        if name.startswith("AWS_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", ACCESS_KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET_KEY)


@pytest.fixture
def s3(aws_env, small_model, monkeypatch):
    """In-process moto with the small model under s3://models/small."""
    with mock_aws():
        # mock_aws puts its own fake keys in the environment; use ours so the tests can look for them.
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", ACCESS_KEY)
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET_KEY)
        client = boto3.client("s3")
        client.create_bucket(Bucket=BUCKET)
        upload_folder(client, small_model, BUCKET, "small")
        yield client


@pytest.fixture(scope="module")
def moto_server():
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield port
    server.stop()


@pytest.fixture
def served_s3(moto_server, aws_env, small_model, monkeypatch):
    """A real moto server holding the small model, reached through a TcpProxy set in AWS_ENDPOINT_URL_S3 so tests
    can slow the network down or break it. Yields the proxy."""
    requests.post(f"http://127.0.0.1:{moto_server}/moto-api/reset", timeout=10)
    proxy = TcpProxy(moto_server)
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", proxy.url)
    client = boto3.client("s3")
    client.create_bucket(Bucket=BUCKET)
    upload_folder(client, small_model, BUCKET, "small")
    yield proxy
    proxy.close()


def run_jobs(config: EngineConfig, *job_inputs) -> list:
    """Each job's first output part, through the job router the handler uses, on an engine for `config`."""
    from engine import AsyncEngine
    from openai_compat.config import ServingConfig
    from openai_compat.jobs import JobRouter
    from openai_compat.serving import OpenAIServing

    engine = AsyncEngine(config)
    router = JobRouter(OpenAIServing(engine, ServingConfig()), ServingConfig())

    async def first_part(job_input):
        return [part async for part in router.run(job_input)][0]

    async def run_all():
        return await asyncio.gather(*(first_part(job) for job in job_inputs))

    try:
        return asyncio.run(run_all())
    finally:
        engine.close()


def resolve(source: str, cache: Path, **kwargs) -> model_store.LocalModel:
    return model_store.resolve(source, revision=kwargs.pop("revision", None), cache_dir=cache, **kwargs)


def cache_entries(cache: Path, kind: str = "s3") -> list[Path]:
    """Complete-looking cache entries (temporary folders start with a dot)."""
    folder = cache / "models" / kind
    return sorted(p for p in folder.iterdir() if p.is_dir() and not p.name.startswith(".")) if folder.is_dir() else []


def files_under(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*")
            if p.is_file() and p.name != MANIFEST_NAME}


def same_files(a: Path, b: Path) -> bool:
    return files_under(a) == files_under(b)


def block_network(monkeypatch) -> list:
    """From now on any attempt to open a network connection in this process fails; returns the attempts."""
    attempts = []

    def refuse(sock, address):
        attempts.append(address)
        raise OSError(f"network call to {address} where none may happen")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)
    return attempts


# ---------------------------------------------------------------- loading and generating from S3


@pytest.mark.slow
def test_model_name_s3_loads_and_generates_like_the_local_copy(s3, small_model, local_completion, tmp_path,
                                                               monkeypatch):
    from worker.settings import load_settings

    monkeypatch.setenv("MODEL_NAME", URI)
    monkeypatch.setenv("BASE_PATH", str(tmp_path / "cache"))
    (body,) = run_jobs(load_settings().engine_config(), {"openai_route": "/v1/completions",
                                                        "openai_input": COMPLETION})
    assert body["model"] == URI
    assert body["choices"][0]["text"] == local_completion["choices"][0]["text"]
    assert body["usage"] == local_completion["usage"] and body["usage"]["completion_tokens"] == 12
    (entry,) = cache_entries(tmp_path / "cache")
    assert same_files(small_model, entry) and manifest_intact(entry)


@pytest.mark.slow
def test_tokenizer_name_from_s3_needs_no_config_json(s3, small_model, local_completion, tmp_path):
    for name in ("tokenizer.json", "tokenizer_config.json"):
        s3.upload_file(str(small_model / name), BUCKET, f"tokenizer-only/{name}")
    (body,) = run_jobs(EngineConfig(model=URI, tokenizer=f"s3://{BUCKET}/tokenizer-only", cache_dir=tmp_path),
                       {"openai_route": "/v1/completions", "openai_input": COMPLETION})
    assert body["choices"][0]["text"] == local_completion["choices"][0]["text"]
    assert len(cache_entries(tmp_path)) == 2


@pytest.mark.slow
def test_handler_process_serves_model_name_from_moto_server(served_s3, local_completion, tmp_path):
    """The worker as deployed: handler.py in its own process, configured only by environment variables."""
    from engine.cpu import native_kernels

    job = {"input": {"openai_route": "/v1/completions", "openai_input": COMPLETION}}
    # The suite's CPU kernel build (NATIVE_KERNELS_DIR), not a compile into the fresh BASE_PATH: the download is
    # under test here, the compiler is not (it cost this test three minutes).
    result = subprocess.run([sys.executable, "handler.py", "--test_input", json.dumps(job)], cwd=ROOT,
                            capture_output=True, text=True, timeout=300,
                            env={**os.environ, "MODEL_NAME": URI, "BASE_PATH": str(tmp_path),
                                 "NATIVE_KERNELS_DIR": str(native_kernels.build_dir())})
    assert result.returncode == 0, result.stderr[-3000:]
    output = json.loads(result.stdout)["output"][0]
    assert output["choices"][0]["text"] == local_completion["choices"][0]["text"]
    assert f"{URI}: downloaded 5 files" in result.stderr
    assert SECRET_KEY not in result.stderr and ACCESS_KEY not in result.stderr


# ---------------------------------------------------------------- the cache


def test_second_start_uses_the_cache_without_any_network_call(served_s3, small_model, tmp_path, caplog,
                                                              monkeypatch):
    caplog.set_level(logging.INFO)
    first = resolve(URI, tmp_path)
    assert "downloading 5 files" in caplog.text
    # moto's request log: the 18 MB weights file came in 8 MB ranges (206 responses), not in one GET.
    assert len(re.findall(r"GET /models/small/model.safetensors .* 206", caplog.text)) == 3
    served_s3.close()  # the endpoint is gone: a listing or download now could only fail
    caplog.clear()
    started = time.monotonic()
    attempts = block_network(monkeypatch)
    second = resolve(URI, tmp_path)
    assert attempts == []
    assert second == first and same_files(small_model, second.path)
    assert "using the cached copy" in caplog.text and "downloading" not in caplog.text
    assert time.monotonic() - started < 5


@pytest.mark.slow
def test_revision_label_keys_the_cache(s3, tmp_path):
    default = resolve(URI, tmp_path)
    labelled = resolve(URI, tmp_path, revision="v2")
    assert default.path != labelled.path and len(cache_entries(tmp_path)) == 2
    assert json.loads((labelled.path / MANIFEST_NAME).read_text())["revision"] == "v2"


def test_damaged_cache_entry_is_downloaded_again(s3, small_model, tmp_path, caplog):
    entry = resolve(URI, tmp_path).path
    with open(entry / "model.safetensors", "r+b") as file:
        file.truncate(1000)  # a half-written file, as a full disk or a careless copy leaves
    assert not manifest_intact(entry)
    caplog.set_level(logging.INFO, logger="engine.sources")
    assert resolve(URI, tmp_path).path == entry
    assert "incomplete or damaged" in caplog.text and "downloading 5 files" in caplog.text
    assert same_files(small_model, entry)


# ---------------------------------------------------------------- failures


@pytest.mark.slow
@pytest.mark.parametrize("uri, setup, cause", [
    ("s3://no-such-bucket/small", None, "the bucket does not exist"),
    (f"s3://{BUCKET}/missing", None, "no objects under prefix 'missing/' in bucket models"),
    (f"s3://{BUCKET}/empty", {"empty/": b""}, "no objects under prefix 'empty/'"),
    (f"s3://{BUCKET}/weights-only", {"weights-only/model.safetensors": b"x" * 10}, "no config.json"),
])
def test_unusable_sources_fail_with_the_uri_and_cause(s3, tmp_path, uri, setup, cause):
    for key, body in (setup or {}).items():
        s3.put_object(Bucket=BUCKET, Key=key, Body=body)
    with pytest.raises(ModelSourceError) as failure:
        resolve(uri, tmp_path)
    message = str(failure.value)
    assert uri in message and cause in message
    assert "\n" not in message
    assert cache_entries(tmp_path) == []


@pytest.mark.slow
@pytest.mark.parametrize("key, reason", [
    ("evil/../escaped.txt", "contains '..'"),
    ("evil/sub/../../../escaped.txt", "contains '..'"),
    ("evil//tmp/escaped.txt", "is an absolute path"),
])
def test_keys_escaping_the_model_folder_are_refused(s3, small_model, tmp_path, key, reason):
    upload_folder(s3, small_model, BUCKET, "evil")
    s3.put_object(Bucket=BUCKET, Key=key, Body=b"written outside the model folder")
    cache = tmp_path / "cache"
    with pytest.raises(ModelSourceError) as failure:
        resolve(f"s3://{BUCKET}/evil", cache)
    assert key.removeprefix("evil/") in str(failure.value) and reason in str(failure.value)
    assert cache_entries(cache) == []
    assert not any(p.name == "escaped.txt" for p in tmp_path.rglob("*"))
    assert not Path("/tmp/escaped.txt").exists()


@pytest.fixture
def s3_with_auth(s3, monkeypatch):
    """moto checking every request's credentials against its IAM: `reader` may read the bucket, `nobody` holds
    valid keys with no permissions. Yields their keys."""
    from moto import settings as moto_settings
    from moto.core.authorization import ActionAuthenticatorMixin

    iam = boto3.client("iam")
    keys = {}
    for user in ("reader", "nobody"):
        iam.create_user(UserName=user)
        keys[user] = iam.create_access_key(UserName=user)["AccessKey"]
    iam.put_user_policy(UserName="reader", PolicyName="read", PolicyDocument=json.dumps({
        "Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": ["s3:ListBucket", "s3:GetObject"],
                                                "Resource": "*"}]}))
    monkeypatch.setattr(moto_settings, "INITIAL_NO_AUTH_ACTION_COUNT", 0)
    monkeypatch.setattr(ActionAuthenticatorMixin, "request_count", 0)
    yield keys


@pytest.mark.slow
@pytest.mark.parametrize("who, cause", [
    ("unknown key", "the access key id is not known"),
    ("wrong secret", "the secret access key does not match"),
    ("nobody", "access denied"),
])
def test_bad_credentials_fail_clearly_without_showing_them(s3_with_auth, tmp_path, monkeypatch, who, cause):
    reader = s3_with_auth["reader"]
    key_id, secret = {"unknown key": ("AKIAUNKNOWNKEY000000", "unknown-secret-value-do-not-log"),
                      "wrong secret": (reader["AccessKeyId"], "wrong-secret-value-do-not-log"),
                      "nobody": (s3_with_auth["nobody"]["AccessKeyId"], s3_with_auth["nobody"]["SecretAccessKey"])}[who]
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", key_id)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    with pytest.raises(ModelSourceError) as failure:
        resolve(URI, tmp_path)
    message = str(failure.value)
    assert URI in message and cause in message
    assert key_id not in message and secret not in message
    # The same bucket with the reader's keys works: the failures above are the credentials'.
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", reader["AccessKeyId"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", reader["SecretAccessKey"])
    assert manifest_intact(resolve(URI, tmp_path).path)


def test_missing_credentials_fail_clearly(s3, tmp_path, monkeypatch):
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    with pytest.raises(ModelSourceError, match="no usable AWS credentials") as failure:
        resolve(URI, tmp_path)
    assert URI in str(failure.value)


def test_unreachable_endpoint_fails_fast(aws_env, tmp_path, monkeypatch):
    endpoint = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", endpoint)
    started = time.monotonic()
    with pytest.raises(ModelSourceError) as failure:
        resolve(URI, tmp_path)
    assert time.monotonic() - started < 15
    message = str(failure.value)
    assert URI in message and endpoint in message and "network error" in message


@pytest.mark.slow
def test_network_failure_mid_download_leaves_nothing_behind(served_s3, small_model, tmp_path):
    served_s3.cut_after = 4 * 2**20  # part-way through the 18 MB weights file
    with pytest.raises(ModelSourceError) as failure:
        resolve(URI, tmp_path)
    assert URI in str(failure.value) and "network error" in str(failure.value)
    leftovers = [p for p in (tmp_path / "models" / "s3").iterdir() if not p.name.endswith(".lock")]
    assert leftovers == []  # no entry, and no temporary folder either
    served_s3.heal()
    assert same_files(small_model, resolve(URI, tmp_path).path)


_RESOLVE_SCRIPT = """
import json, logging, os, sys, time
from pathlib import Path
logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(name)s: %(message)s")
from engine.sources import store as model_store
go = Path(sys.argv[2])
Path(f"{go}.ready-{os.getpid()}").touch()
while not go.exists():  # imports done: start together with the other process
    time.sleep(0.01)
print(json.dumps({"path": str(model_store.resolve(sys.argv[1], revision=None, cache_dir=Path(sys.argv[3])).path)}))
"""


def start_resolving(uri: str, cache: Path, go: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", _RESOLVE_SCRIPT, uri, str(go), str(cache)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _bytes_in(folder: Path) -> int:
    """Bytes of the files in a folder that a download is writing into (a part file may be renamed as we look)."""
    total = 0
    for path in folder.rglob("*"):
        try:
            total += path.stat().st_size if path.is_file() else 0
        except FileNotFoundError:
            pass
    return total


@pytest.mark.slow
def test_crash_mid_download_leaves_no_complete_looking_folder(served_s3, small_model, tmp_path):
    served_s3.bytes_per_s = 2 * 2**20
    go = tmp_path / "go"
    go.touch()
    process = start_resolving(URI, tmp_path, go)
    try:
        deadline = time.monotonic() + 120
        while True:
            scratch = list((tmp_path / "models" / "s3").glob(".*.tmp-*")) if (tmp_path / "models").exists() else []
            if scratch and _bytes_in(scratch[0]) > 2**20:
                break
            assert process.poll() is None, process.stderr.read()[-3000:]
            assert time.monotonic() < deadline, "the download never started"
            time.sleep(0.05)
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=30)
    finally:
        process.kill()
        process.communicate()
    assert cache_entries(tmp_path) == []  # only the temporary folder: nothing that looks complete
    assert scratch[0].exists()
    served_s3.heal()
    entry = resolve(URI, tmp_path).path
    assert same_files(small_model, entry)
    assert not scratch[0].exists()  # the next builder cleared the dead one's leftovers


@pytest.mark.slow
def test_two_processes_starting_together_download_once(served_s3, small_model, tmp_path):
    served_s3.bytes_per_s = 4 * 2**20  # a download of a few seconds: the second process arrives during it
    go = tmp_path / "go"
    processes = [start_resolving(URI, tmp_path / "cache", go) for _ in range(2)]
    deadline = time.monotonic() + 120
    while len(list(tmp_path.glob("go.ready-*"))) < 2:
        assert all(p.poll() is None for p in processes) and time.monotonic() < deadline
        time.sleep(0.02)
    go.touch()
    results = [p.communicate(timeout=240) for p in processes]
    assert [p.returncode for p in processes] == [0, 0], [err[-3000:] for _, err in results]
    paths = {json.loads(out)["path"] for out, _ in results}
    logs = "".join(err for _, err in results)
    assert len(paths) == 1
    assert logs.count("downloading 5 files") == 1
    assert logs.count("waiting for another process") == 1 and logs.count("using the cached copy") == 1
    assert same_files(small_model, Path(paths.pop()))


def test_a_build_finished_elsewhere_meanwhile_is_kept(tmp_path):
    """Where the volume does not share file locks between machines, two may build the same entry at once."""
    target = tmp_path / "entry"
    with building(target) as scratch:
        (scratch / "mine").write_text("mine")
        target.mkdir()  # another machine's finished copy, renamed in while this one was downloading
        (target / "theirs").write_text("theirs")
    assert [p.name for p in target.iterdir()] == ["theirs"]
    assert list(tmp_path.glob(".entry.tmp-*")) == []


def test_credentials_never_reach_the_log(served_s3, tmp_path, caplog, monkeypatch):
    monkeypatch.setenv("AWS_SESSION_TOKEN", SESSION_TOKEN)
    caplog.set_level(logging.DEBUG)  # the most a LOG_LEVEL can show
    resolve(URI, tmp_path)
    with pytest.raises(ModelSourceError) as failure:
        resolve(f"s3://{BUCKET}/missing", tmp_path)
    logged = caplog.text + str(failure.value)
    assert "downloading 5 files" in logged
    for secret in (ACCESS_KEY, SECRET_KEY, SESSION_TOKEN):
        assert secret not in logged


# ---------------------------------------------------------------- jobs and the entrypoint when loading fails


def test_jobs_fail_with_the_load_error_instead_of_hanging(s3, tmp_path):
    uri = f"s3://{BUCKET}/missing"
    chat = {"openai_route": "/v1/chat/completions", "openai_input": {"messages": [{"role": "user", "content": "hi"}]}}
    bodies = run_jobs(EngineConfig(model=uri, cache_dir=tmp_path), chat,
                      {"openai_route": "/v1/completions", "openai_input": COMPLETION})
    for body in bodies:
        assert body["error"]["code"] == 500
        assert uri in body["error"]["message"] and "no objects under prefix" in body["error"]["message"]


@pytest.mark.slow
def test_deploy_mode_exits_with_one_line_naming_the_uri(served_s3, tmp_path):
    uri = f"s3://{BUCKET}/missing"
    result = subprocess.run([sys.executable, "handler.py"], cwd=ROOT, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "MODEL_NAME": uri, "BASE_PATH": str(tmp_path),
                                 "RUNPOD_WEBHOOK_GET_JOB": "http://127.0.0.1:9/unused"})
    assert result.returncode == 1
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(f"llm-worker: model load failed: cannot download {uri}")
    assert "no objects under prefix" in last


# ---------------------------------------------------------------- baked models


@pytest.mark.slow
def test_baked_model_loads_with_no_network_call(served_s3, small_model, local_completion, tmp_path, monkeypatch):
    baked = tmp_path / "baked"
    # What the Dockerfile runs at build time.
    result = subprocess.run([sys.executable, "-m", "engine.sources.prefetch"], cwd=ROOT, capture_output=True, text=True,
                            timeout=300, env={**os.environ, "BAKED_MODEL_DIR": str(baked), "MODEL_NAME": URI})
    assert result.returncode == 0, result.stderr[-3000:]
    record = json.loads((baked / model_store.BAKED_RECORD_NAME).read_text())
    assert [(e["source"], e["revision"]) for e in record["models"]] == [(URI, None)]
    served_s3.close()

    attempts = block_network(monkeypatch)
    cache = tmp_path / "runtime-cache"
    (body,) = run_jobs(EngineConfig(model=URI, cache_dir=cache, baked_model_dir=baked),
                       {"openai_route": "/v1/completions", "openai_input": COMPLETION})
    assert body["choices"][0]["text"] == local_completion["choices"][0]["text"]
    assert attempts == [] and not cache.exists()


@pytest.mark.slow
def test_baked_record_applies_only_to_its_source_and_revision(served_s3, tmp_path):
    baked = tmp_path / "baked"
    from engine.sources.prefetch import main as prefetch
    assert prefetch(["--into", str(baked), "--model", URI, "--revision", "v1"]) == 0
    assert model_store.baked_location(baked, URI, "v1") is not None
    assert model_store.baked_location(baked, URI + "/", "v1") is not None
    assert model_store.baked_location(baked, URI, None) is None
    assert model_store.baked_location(baked, f"s3://{BUCKET}/other", "v1") is None


# ---------------------------------------------------------------- the Hugging Face Hub, offline


def test_hub_repo_offline_fails_clearly_and_fast(tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_TOKEN", "hf_model_source_test_token_do_not_log")
    started = time.monotonic()
    with pytest.raises(ModelSourceError) as failure:
        resolve("llm-worker-tests/no-such-model", tmp_path)
    message = str(failure.value)
    assert "llm-worker-tests/no-such-model" in message and "offline mode is on (HF_HUB_OFFLINE)" in message
    assert "hf_model_source_test_token_do_not_log" not in message
    assert time.monotonic() - started < 10
    assert cache_entries(tmp_path, "hf") == []


def test_hub_unreachable_fails_clearly_and_fast(tmp_path, monkeypatch):
    from huggingface_hub import constants

    endpoint = f"http://127.0.0.1:{free_port()}"
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", endpoint)
    started = time.monotonic()
    with pytest.raises(ModelSourceError) as failure:
        resolve("llm-worker-tests/no-such-model", tmp_path, role="tokenizer")
    message = str(failure.value)
    assert "llm-worker-tests/no-such-model" in message and endpoint in message and "Connect" in message
    assert time.monotonic() - started < 30


# ---------------------------------------------------------------- a Hub cache on the host (RunPod's cached models)

CACHED_REPO = "llm-worker-tests/cached-small"
COMMIT_MAIN, COMMIT_V2 = "a" * 40, "b" * 40


def hub_cache_layout(root: Path, model: Path, commits: dict[str, str], *, drop: str | None = None) -> Path:
    """`model`'s files in the Hub's cache layout under `root` (as RunPod's model cache and huggingface_hub write
    it): blobs named by hash, each snapshot's files links to them, refs naming commits. `drop` leaves one blob
    out (a link that resolves to nothing)."""
    repo = root / f"models--{CACHED_REPO.replace('/', '--')}"
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    for ref, commit in commits.items():
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
        snapshot = repo / "snapshots" / commit
        snapshot.mkdir(parents=True, exist_ok=True)
        for file in model.iterdir():
            blob = repo / "blobs" / f"{commit[:8]}-{file.name}"
            if file.name != drop:
                blob.write_bytes(file.read_bytes())
            (snapshot / file.name).symlink_to(os.path.relpath(blob, snapshot))
    return repo


@pytest.fixture
def no_hub(monkeypatch):
    """An endpoint nothing listens on: any download attempt fails, naming it."""
    from huggingface_hub import constants
    endpoint = f"http://127.0.0.1:{free_port()}"
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", endpoint)
    return endpoint


def test_a_model_in_the_hub_cache_loads_in_place_with_no_network_call(small_model, local_completion, tmp_path,
                                                                        monkeypatch, no_hub, caplog):
    hub = tmp_path / "hub"
    repo = hub_cache_layout(hub, small_model, {"main": COMMIT_MAIN})
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    cache = tmp_path / "worker-cache"
    with caplog.at_level(logging.INFO, logger="engine.sources"):
        local = resolve(CACHED_REPO, cache)
    assert local.path == repo / "snapshots" / COMMIT_MAIN  # in place: no copy into the worker's cache
    assert cache_entries(cache, "hf") == []
    assert f"using the copy in the Hub cache at {repo / 'snapshots' / COMMIT_MAIN}" in caplog.text
    # The engine serves it, as it serves the same files from a plain folder.
    completion = run_jobs(EngineConfig(model=CACHED_REPO, cache_dir=cache),
                          {"openai_route": "/v1/completions", "openai_input": COMPLETION})[0]
    assert completion["choices"] == local_completion["choices"]


def test_the_hub_cache_is_used_at_the_revision_asked_for(small_model, tmp_path, monkeypatch, no_hub):
    hub = tmp_path / "hub"
    repo = hub_cache_layout(hub, small_model, {"main": COMMIT_MAIN, "v2": COMMIT_V2})
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    assert resolve(CACHED_REPO, tmp_path, revision="v2").path == repo / "snapshots" / COMMIT_V2
    assert resolve(CACHED_REPO, tmp_path, revision=COMMIT_V2).path == repo / "snapshots" / COMMIT_V2
    assert resolve(CACHED_REPO, tmp_path, revision=COMMIT_MAIN[:10]).path == repo / "snapshots" / COMMIT_MAIN
    assert resolve(CACHED_REPO, tmp_path, role="tokenizer").path == repo / "snapshots" / COMMIT_MAIN
    # A revision the cache does not hold is downloaded (here: an endpoint that does not answer).
    with pytest.raises(ModelSourceError, match=re.escape(no_hub)):
        resolve(CACHED_REPO, tmp_path, revision="v3")


def test_an_incomplete_snapshot_in_the_hub_cache_is_not_used(small_model, tmp_path, monkeypatch, no_hub, caplog):
    hub = tmp_path / "hub"
    hub_cache_layout(hub, small_model, {"main": COMMIT_MAIN}, drop="model.safetensors")
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    with caplog.at_level(logging.WARNING, logger="engine.sources"), \
            pytest.raises(ModelSourceError, match=re.escape(no_hub)):
        resolve(CACHED_REPO, tmp_path)
    assert "is incomplete (no weight files); not using it" in caplog.text
    # The tokenizer alone is there: TOKENIZER_NAME can use it.
    assert resolve(CACHED_REPO, tmp_path, role="tokenizer").path.name == COMMIT_MAIN


# ---------------------------------------------------------------- local forms


def test_local_forms(small_model, tmp_path):
    assert resolve(str(small_model), tmp_path) == model_store.LocalModel(small_model, str(small_model))
    gguf_folder = tmp_path / "gguf"
    gguf_folder.mkdir()
    (gguf_folder / "tiny.Q4_0.gguf").write_bytes(b"GGUF")
    assert resolve(str(gguf_folder / "tiny.Q4_0.gguf"), tmp_path).gguf_file == "tiny.Q4_0.gguf"
    assert resolve(str(gguf_folder), tmp_path).gguf_file == "tiny.Q4_0.gguf"
    with pytest.raises(ModelSourceError, match="does not exist"):
        resolve(str(tmp_path / "absent"), tmp_path)
    with pytest.raises(ModelSourceError, match="unsupported scheme"):
        resolve("gs://bucket/model", tmp_path)
    with pytest.raises(ModelSourceError, match="not a local folder"):
        resolve("no/such//thing", tmp_path)
    with pytest.raises(ModelSourceError, match="no bucket name"):
        resolve("s3:///prefix", tmp_path)
