"""moto's S3 server for the object-store tests (``--checkpoint_dir s3://...``): a subprocess on a free loopback
port, never a thread (the test process forks ranks), a bucket in it, and the environment s3fs and boto3 read their
endpoint and keys from. The ``s3`` fixture of tests/conftest.py serves one server to every test of a pytest process
(each test uses a prefix of its own, ``new_prefix``), its environment set for the test only."""

from __future__ import annotations

import contextlib
import importlib.util
import signal
import socket
import subprocess
import sys
import time
import uuid

import pytest

from tests.helpers.multiproc import free_port

BUCKET = "accel-ddp-test"


def s3_env(port: int) -> dict[str, str]:
    """The environment s3fs and boto3 read their endpoint and keys from, for a store on loopback ``port``."""
    return {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}"}


@contextlib.contextmanager
def s3_server():
    """moto's server up with BUCKET in it: a boto3 client of it, its process (a test stops it with SIGSTOP: a store
    that stops answering) and its ``s3_env``. The process's environment is left as it is: a fixture sets ``env`` for
    the tests that use the server (the ranks they fork inherit it)."""
    missing = [name for name in ("moto", "s3fs", "boto3", "flask") if importlib.util.find_spec(name) is None]
    if missing:
        pytest.skip(f"the object-store tests need {', '.join(missing)} (pip install -e '.[test]')")
    import boto3
    import s3fs  # noqa: F401 - here, once: every rank forked later has it (~0.4 s of import each, per run)

    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    env = s3_env(port)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline or server.poll() is not None:
                    pytest.fail("moto's S3 server did not start")
                time.sleep(0.02)  # it listens ~1 s after its start (imports): found within 20 ms of it
        client = boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"], region_name=env["AWS_DEFAULT_REGION"],
                              aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
                              aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"])
        client.create_bucket(Bucket=BUCKET)
        yield client, server, env
    finally:
        server.send_signal(signal.SIGCONT)  # a test that stopped it
        server.kill()  # nothing of it to keep: SIGTERM's orderly exit took ~0.9 s of the last test's wall
        server.wait(timeout=30)


def new_prefix() -> str:
    """A prefix of the bucket no other test uses."""
    return f"run-{uuid.uuid4().hex[:8]}"
