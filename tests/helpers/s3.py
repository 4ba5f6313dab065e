"""moto's S3 server for the object-store tests (``--checkpoint_dir s3://...``): a subprocess on a free loopback
port, never a thread (the test process forks ranks), a bucket in it, and the environment s3fs and boto3 read their
endpoint and keys from. The ``s3`` fixture of tests/conftest.py serves one server to every test of a pytest process
(each test uses a prefix of its own, ``new_prefix``), its environment set for the test only."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import signal
import socket
import subprocess
import sys
import time
import uuid

import pytest

from tests.helpers.multiproc import free_port

BUCKET = "accel-ddp-test"
S3_ENV = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION", "AWS_ENDPOINT_URL")


@contextlib.contextmanager
def s3_server():
    """The server up with BUCKET in it; a boto3 client, and the environment that reaches it (the ``s3`` fixture sets it
    for each test that uses the server; the process's own environment is left as it was)."""
    outside = {key: os.environ.get(key) for key in S3_ENV}
    with s3_server_process() as (client, _), pytest.MonkeyPatch.context() as patch:
        env = {key: os.environ[key] for key in S3_ENV}
        for key, value in outside.items():  # the tests that do not ask for the server run as before it started
            if value is None:
                patch.delenv(key, raising=False)
            else:
                patch.setenv(key, value)
        yield client, env


@contextlib.contextmanager
def s3_server_process():
    """``s3_server``'s, with the server's process too (a test stops it with SIGSTOP: a store that stops answering)."""
    missing = [name for name in ("moto", "s3fs", "boto3", "flask") if importlib.util.find_spec(name) is None]
    if missing:
        pytest.skip(f"the object-store tests need {', '.join(missing)} (pip install -e '.[test]')")
    import boto3
    import s3fs  # noqa: F401 - here, once: every rank forked later has it (~0.4 s of import each, per run)

    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
           "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}"}
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)  # the forked ranks inherit it
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline or server.poll() is not None:
                    pytest.fail("moto's S3 server did not start")
                time.sleep(0.2)
        client = boto3.client("s3")
        client.create_bucket(Bucket=BUCKET)
        yield client, server
    finally:
        server.send_signal(signal.SIGCONT)  # a test that stopped it
        server.terminate()
        server.wait(timeout=30)
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def new_prefix() -> str:
    """A prefix of the bucket no other test uses."""
    return f"run-{uuid.uuid4().hex[:8]}"
