"""An object store that stops answering (its server process stopped with SIGSTOP, not closed: the kernel still
accepts connections, nothing answers): every call ends within ``--store_timeout``, a save ends with one line naming
the store and the bound on every rank (exit 2), a stop signal during a stuck save stops the run with exit 75, and
the checkpoint before it stays intact and resumable."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
import sys
import threading

import pytest

from tests.helpers.multiproc import run_ranks
from tests.helpers.ranks import error_lines
from tests.helpers.runs import main_ranks, read_summary
from tests.helpers.s3 import BUCKET, new_prefix, s3_env, s3_server

# 8 optimizer steps an epoch; a checkpoint every 2 of them
ARGS = ["--dataset", "synthetic", "--synthetic_samples", "128", "--synthetic_shape", "1", "4", "4",
        "--model", "mlp", "--hidden_size", "8", "--global_batch_size", "16", "--num_workers", "0",
        "--lr_schedule", "constant", "--checkpointing_steps", "2", "--keep_last", "5", "--log_every", "2",
        "--max_steps", "8"]


@pytest.fixture(scope="module")
def moto_server():
    """moto's S3 server of this module's tests alone (they stop it) and its process. One for the module: a server
    stopped and continued (SIGCONT) answers again, and each test writes under a prefix of its own; a start costs
    an interpreter."""
    with s3_server() as served:
        yield served


@pytest.fixture
def moto(moto_server, monkeypatch):
    """``moto_server``, its environment set for the test, answering again after it (SIGCONT), with s3fs's cached
    file systems dropped before and after it, so that none made for another endpoint, or with a connection to the
    stopped server, is reused."""
    import s3fs

    client, server, env = moto_server
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    s3fs.S3FileSystem.clear_instance_cache()
    try:
        yield client, server
    finally:
        server.send_signal(signal.SIGCONT)
        s3fs.S3FileSystem.clear_instance_cache()


def _sealed_steps(client, prefix: str) -> list[int]:
    listed = client.list_objects_v2(Bucket=BUCKET, Prefix=f"{prefix}/").get("Contents", [])
    sealed = (re.fullmatch(rf"{prefix}/step_(\d{{8}})/checkpoint\.json", obj["Key"]) for obj in listed)
    return sorted(int(match.group(1)) for match in sealed if match)


def _stopped_at_seal(args: list[str], step: int, server_pid: int, then=None) -> list[int]:
    """The CLI on 2 forked ranks; as the main process starts to seal ``step``, the store's server is stopped
    (SIGSTOP) and ``then(pids)`` runs (the ranks' pids)."""
    ready = [os.pipe() for _ in range(2)]

    def rank() -> int:
        from accel_ddp.checkpoint import storage
        from accel_ddp.cli.train import main

        me = int(os.environ["RANK"])
        os.write(ready[me][1], str(os.getpid()).encode())
        seal = storage.ObjectStore.seal

        def hooked(self, tmp, final, meta):
            if final.endswith(f"step_{step:08d}"):
                os.kill(server_pid, signal.SIGSTOP)
                if then is not None:
                    then([int(os.read(r, 32)) for r, _ in ready])
            return seal(self, tmp, final, meta)

        storage.ObjectStore.seal = hooked
        return main(args)

    return run_ranks(rank, timeout=180)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_store_that_stops_answering_mid_save_ends_every_rank_with_one_line_and_exit_2(mode, moto, tmp_path, capfd):
    """Step 2 sealed; the server stopped as step 4's seal begins: the seal's first call ends past --store_timeout
    (2 s), every rank exits 2 with one line naming the store and the bound; step 2 stays sealed, the staging folder
    holds no .tmp-step_00000004, and the same command with auto resumes from step 2 (taking over the lock the stalled
    run had to leave)."""
    client, server = moto
    prefix, out = new_prefix(), tmp_path / "run"
    url = f"s3://{BUCKET}/{prefix}"
    args = [*ARGS, "--output_dir", str(out), "--checkpoint_dir", url, "--store_timeout", "2",
            *(["--async_checkpointing"] if mode == "async" else [])]
    try:
        codes = _stopped_at_seal(args, 4, server.pid)
    finally:
        server.send_signal(signal.SIGCONT)
    err = capfd.readouterr().err
    assert codes == [2, 2], err
    lines = error_lines(err)
    assert len(lines) == 1, err
    assert f"--checkpoint_dir {url}: the store did not finish" in lines[0], lines
    assert "(--store_timeout 2" in lines[0] and "it stopped answering" in lines[0], lines
    assert "Traceback" not in err
    assert _sealed_steps(client, prefix) == [2]
    assert not any(name.startswith(".tmp-") for name in os.listdir(out / "checkpoints"))

    assert main_ranks([*args, "--resume_from_checkpoint", "auto"]) == [0, 0]
    assert read_summary(out)["resumed_from_step"] == 2
    assert _sealed_steps(client, prefix) == [2, 4, 6, 8]


@pytest.mark.slow
def test_sigterm_during_a_stuck_save_stops_every_rank_with_75_and_the_previous_checkpoint_intact(moto, tmp_path,
                                                                                                 capfd, monkeypatch):
    """--store_timeout 600: only the signal ends the stuck call. SIGTERM to both ranks, as torchrun sends it, while
    step 4's seal waits on the stopped server: the call gives up STOP_GRACE_S later, every rank exits 75 with one
    line saying that step 4 was not saved and that step 2 is intact; auto then resumes from step 2. The grace is 1 s
    here (the forked ranks inherit it), not 5: the same cut (the stopped server never answers), 4 s less waiting."""
    from accel_ddp.checkpoint import store_calls

    monkeypatch.setattr(store_calls, "STOP_GRACE_S", 1.0)
    STOP_GRACE_S = store_calls.STOP_GRACE_S

    client, server = moto
    prefix, out = new_prefix(), tmp_path / "run"
    url = f"s3://{BUCKET}/{prefix}"
    args = [*ARGS, "--output_dir", str(out), "--checkpoint_dir", url, "--store_timeout", "600"]

    def sigterm_once_the_call_waits(pids: list[int]) -> None:
        """SIGTERM to both ranks right after the seal's first call is handed to the file system's loop: the call
        has read that no stop signal came (one before it would let the save run in full, store_calls._bounded) and
        waits on the stopped server."""
        submit = asyncio.run_coroutine_threadsafe

        def submitted_then_signalled(coroutine, loop):
            future = submit(coroutine, loop)
            if sys._getframe(1).f_code is not store_calls.BoundedCalls._bounded.__code__:
                return future  # fsspec's own sync() submits through it too: not the bounded call
            asyncio.run_coroutine_threadsafe = submit
            for pid in pids:
                os.kill(pid, signal.SIGTERM)
            return future

        asyncio.run_coroutine_threadsafe = submitted_then_signalled

    try:
        codes = _stopped_at_seal(args, 4, server.pid, then=sigterm_once_the_call_waits)
    finally:
        server.send_signal(signal.SIGCONT)
    err = capfd.readouterr().err
    assert codes == [75, 75], err
    stops = [line for line in err.split("\n") if line.startswith("accel_ddp: preempted:")]
    assert len(stops) == 1, err
    assert "SIGTERM received: stopped after optimizer step 4 without its checkpoint" in stops[0], stops
    assert f"{STOP_GRACE_S:.0f} s after the stop signal" in stops[0], stops
    assert f"{url}/step_00000002, the last checkpoint, is intact" in stops[0], stops
    assert "Traceback" not in err and not error_lines(err), err
    assert _sealed_steps(client, prefix) == [2]

    assert main_ranks([*args, "--resume_from_checkpoint", "auto"]) == [0, 0]
    assert read_summary(out)["resumed_from_step"] == 2


@pytest.fixture
def silent_endpoint(monkeypatch):
    """A TCP server on loopback that accepts every connection and never answers, as s3fs's endpoint."""
    import s3fs

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(64)
    server.settimeout(0.1)
    held: list[socket.socket] = []
    done = threading.Event()

    def accept() -> None:
        while not done.is_set():
            try:
                held.append(server.accept()[0])
            except OSError:  # the timeout: look at done again
                pass

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    for key, value in s3_env(server.getsockname()[1]).items():
        monkeypatch.setenv(key, value)
    s3fs.S3FileSystem.clear_instance_cache()
    yield
    done.set()
    thread.join(timeout=5)
    server.close()
    for conn in held:
        conn.close()
    s3fs.S3FileSystem.clear_instance_cache()


@pytest.mark.slow  # seven waits of 1-2 s for the bound, by design
@pytest.mark.parametrize("what, method, args", [
    ("lock", "exists", ["bucket/run/.lock"]), ("list", "find", ["bucket/run"]),
    ("upload", "put_file", ["FILE", "bucket/run/step_00000002/model.safetensors"]),
    ("upload", "pipe_file", ["bucket/run/step_00000002/checkpoint.json", b"{}"]),
    ("download", "get_file", ["bucket/run/step_00000002/model.safetensors", "FILE"]),
    ("read", "cat_file", ["bucket/run/step_00000002/checkpoint.json"]), ("delete", "rm_file", ["bucket/run/.lock"]),
])
def test_every_call_to_a_silent_store_ends_within_its_bound_naming_it(what, method, args, silent_endpoint, tmp_path):
    """botocore's own read timeout bounds a GET but not a PUT (its ``Expect: 100-continue``): every kind of call
    the store makes ends with StoreStalled naming the store and --store_timeout (plus 1 s per MiB carried)."""
    from accel_ddp.checkpoint.storage import ObjectStore
    from accel_ddp.checkpoint.store_calls import StoreStalled

    store = ObjectStore("s3://bucket/run", str(tmp_path / "staging"), timeout=1)
    path = tmp_path / "model.safetensors"
    path.write_bytes(b"0" * 2**20)
    args = [str(path) if arg == "FILE" else arg for arg in args]
    carried = r" plus 1 s per MiB" if method == "put_file" else ""
    bound = 2 if method == "put_file" else 1
    with pytest.raises(StoreStalled, match=rf"--checkpoint_dir s3://bucket/run: the store did not finish an? {what} "
                                           rf"within {bound} s \(--store_timeout 1{carried}\): it stopped answering"):
        store._call(what, method, *args, nbytes=path.stat().st_size if method == "put_file" else 0)


def test_a_store_timeout_not_below_the_ddp_timeout_is_refused():
    from accel_ddp.cli.args import parse_args
    from accel_ddp.util.validation import ConfigError

    with pytest.raises(ConfigError, match=r"--store_timeout 60 s is not less than --ddp_timeout 60 s"):
        parse_args(["--checkpoint_dir", "s3://b/run", "--ddp_timeout", "60"])
    assert parse_args(["--ddp_timeout", "60"]).store_timeout == 60  # no store: nothing waits on it
