"""Checkpoints in an object store (``--checkpoint_dir s3://...``), tested against moto's S3 server on loopback;
and URLs where they are not supported (one line, exit 2, never a local folder named after them)."""

from __future__ import annotations

import errno
import importlib
import importlib.util
import json
import os
import re
import shutil
import signal
import socket
import sys
from pathlib import Path

import pytest

from tests.helpers import faults
from tests.helpers.multiproc import RankFailed, run_ranks
from tests.helpers.ranks import error_lines
from tests.helpers.runs import load_weights, main_ranks, read_summary
from tests.helpers.s3 import BUCKET, new_prefix

ARGS = ["--dataset", "synthetic", "--synthetic_samples", "64", "--synthetic_shape", "1", "4", "4",
        "--model", "mlp", "--hidden_size", "8", "--global_batch_size", "16", "--epochs", "1", "--num_workers", "0"]
# 8 optimizer steps an epoch; a checkpoint every 2 of them, the constant LR so that a longer run continues exactly
# (the runs below stop at step 10, in the second epoch)
STORE_ARGS = ["--dataset", "synthetic", "--synthetic_samples", "128", "--synthetic_shape", "1", "4", "4",
              "--model", "mlp", "--hidden_size", "8", "--global_batch_size", "16", "--num_workers", "0",
              "--lr_schedule", "constant", "--checkpointing_steps", "2", "--keep_last", "5", "--log_every", "2"]


@pytest.mark.parametrize("flag, url", [
    ("--output_dir", "s3://bucket/run"),
    ("--output_dir", "gs://bucket/run"),
    ("--output_dir", "az://container/run"),
    ("--resume_from_checkpoint", "s3://bucket/run/checkpoints/step_00000004"),
    ("--init_from", "hf://org/model/model.safetensors"),
])
def test_a_url_is_one_line_exit_2_and_no_local_folder_named_after_it(flag, url, tmp_path, monkeypatch, capfd):
    monkeypatch.chdir(tmp_path)  # where Accelerate's save_state would have made "s3:/bucket/run"
    extra = [] if flag == "--output_dir" else ["--output_dir", str(tmp_path / "run")]
    assert main_ranks([*ARGS, *extra, flag, url]) == [2, 2]
    err = capfd.readouterr().err
    lines = error_lines(err)
    assert len(lines) == 1 and f"{flag} {url}" in lines[0] and "not supported here" in lines[0], err
    if flag == "--output_dir":
        assert f"--checkpoint_dir {url}" in lines[0]
    assert "Traceback" not in err
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("url, package, extra", [("s3://bucket/run", "s3fs", "s3"), ("gs://bucket/run", "gcsfs", "gcs"),
                                                 ("az://container/run", "adlfs", "azure")])
def test_a_store_without_its_package_is_one_line_naming_the_extra(url, package, extra, tmp_path, monkeypatch, capfd):
    monkeypatch.setitem(sys.modules, package, None)  # `import s3fs` fails, as where it is not installed
    assert main_ranks([*ARGS, "--output_dir", str(tmp_path / "run"), "--checkpoint_dir", url]) == [2, 2]
    err = capfd.readouterr().err
    lines = error_lines(err)
    assert len(lines) == 1 and f"--checkpoint_dir {url} needs the {package} package" in lines[0], err
    assert lines[0].endswith(f'pip install "accel_ddp[{extra}]"') and "Traceback" not in err
    assert not (tmp_path / "run").exists()


# ----------------------------------------------------------------------------------------- against a real S3 API


def _keys(client, prefix: str) -> list[str]:
    listed = client.list_objects_v2(Bucket=BUCKET, Prefix=f"{prefix}/")
    return sorted(obj["Key"][len(prefix) + 1:] for obj in listed.get("Contents", []))


def _sealed_steps(client, prefix: str) -> list[int]:
    sealed = (re.fullmatch(r"step_(\d{8})/checkpoint\.json", key) for key in _keys(client, prefix))
    return sorted(int(match.group(1)) for match in sealed if match)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """The uninterrupted 10-step run (``run/``): the weights every resumed store run must end with. Its checkpoints go
    to a ``file://`` store (``store/``, keeping 2), its --output_dir is a ``file://`` URL too: what
    test_a_file_url_store_seals_prunes_and_locks_like_a_bucket reads (a copy: it writes a lock there)."""
    folder = tmp_path_factory.mktemp("reference")
    args = [*STORE_ARGS, "--max_steps", "10", "--keep_last", "2", "--output_dir", f"file://{folder / 'run'}",
            "--checkpoint_dir", f"file://{folder / 'store'}"]
    assert main_ranks(args) == [0, 0]
    return folder


def _assert_same_weights(out, reference: Path) -> None:
    weights, expected = load_weights(out), load_weights(reference / "run")
    assert weights.keys() == expected.keys()
    assert all(weights[k].equal(expected[k]) for k in expected)


def test_a_run_killed_mid_upload_resumes_bitwise_from_the_newest_intact_checkpoint_past_an_unsealed_and_a_damaged_one(
        s3, reference, tmp_path, capfd):
    """Checkpoints at steps 2, 4 and 6 sealed in the store; the whole 2-rank job SIGKILLed while the main process
    uploads step 8 (its model is there, its manifest is not); then an object of step 6 is altered. ``auto`` from the
    same --output_dir takes over the lock object the kill left, ignores unsealed step 8 and skips damaged step 6 with
    a line each (setting its object aside, not deleting it), resumes step 4, the newest intact one, and ends with the
    uninterrupted run's weights, bit for bit; the lock object is gone at the end. A fresh start over the store's
    checkpoints from another output folder is then refused like one on disk."""
    prefix, out, pids = new_prefix(), tmp_path / "run", tmp_path / "pids"
    url = f"s3://{BUCKET}/{prefix}"
    args = [*STORE_ARGS, "--max_steps", "10", "--output_dir", str(out), "--checkpoint_dir", url]
    pids.mkdir()

    def killed_uploading_step_8() -> int:
        from accel_ddp.checkpoint import storage
        from accel_ddp.cli.train import main

        rank = int(os.environ["RANK"])
        (pids / str(rank)).write_text(str(os.getpid()))
        seal = storage.ObjectStore.seal

        def seal_then_die(self, tmp, final, meta):
            if final.endswith("step_00000008"):  # its first object uploaded, then the job dies, as a node fails
                put = self.fs._put_file  # the coroutine: the store runs it on the file system's loop, bounded

                async def put_then_die(*args, **kwargs):
                    await put(*args, **kwargs)
                    for pid in (int((pids / r).read_text()) for r in ("1", "0")):
                        os.kill(pid, signal.SIGKILL)

                self.fs._put_file = put_then_die
            return seal(self, tmp, final, meta)

        storage.ObjectStore.seal = seal_then_die
        return main(args)

    with pytest.raises(RankFailed, match="exited with code -9"):
        run_ranks(killed_uploading_step_8)
    keys = _keys(s3, prefix)
    assert _sealed_steps(s3, prefix) == [2, 4, 6] and ".lock" in keys
    assert any(k.startswith("step_00000008/") for k in keys) and "step_00000008/checkpoint.json" not in keys
    assert not (out / "checkpoints" / "step_00000004").exists()  # the store holds them, not the output folder
    s3.put_object(Bucket=BUCKET, Key=f"{prefix}/step_00000006/optimizer.bin", Body=b"not the saved bytes")
    capfd.readouterr()

    assert main_ranks([*args, "--resume_from_checkpoint", "auto"]) == [0, 0]
    output = capfd.readouterr()
    assert "taking over" in output.out and f"{url}/.lock" in output.out, output.out
    assert f"ignoring {url}/step_00000008: it has no checkpoint.json" in output.err, output.err
    assert f"skipping a damaged checkpoint: {url}/step_00000006/optimizer.bin is truncated or altered" in output.err
    assert read_summary(out)["resumed_from_step"] == 4
    _assert_same_weights(out, reference)
    keys = _keys(s3, prefix)
    assert _sealed_steps(s3, prefix) == [2, 4, 6, 8, 10] and ".lock" not in keys
    assert any(".damaged-" in k and k.endswith("optimizer.bin") for k in keys)  # set aside, not deleted
    # A fresh start over the store's checkpoints, from another output folder, is refused like one on disk.
    assert main_ranks([*STORE_ARGS, "--output_dir", str(tmp_path / "other"), "--checkpoint_dir", url,
                       "--max_steps", "10"]) == [2, 2]
    lines = error_lines(capfd.readouterr().err)
    assert len(lines) == 1 and f"{url} already holds checkpoints (newest step_00000010)" in lines[0], lines
    assert "pick another --checkpoint_dir" in lines[0] and ".lock" not in _keys(s3, prefix)


def test_a_second_run_on_the_same_prefix_is_refused_naming_the_owner(s3, tmp_path, capfd):
    prefix = new_prefix()
    url = f"s3://{BUCKET}/{prefix}"
    owner = {"host": socket.gethostname(), "output_dir": "/elsewhere/run", "pid": 4242, "since": "2026-12-01T23:00"}
    s3.put_object(Bucket=BUCKET, Key=f"{prefix}/.lock", Body=json.dumps(owner).encode())
    out = tmp_path / "run"
    capfd.readouterr()
    assert main_ranks([*STORE_ARGS, "--max_steps", "4", "--output_dir", str(out), "--checkpoint_dir", url]) == [2, 2]
    err = capfd.readouterr().err
    lines = error_lines(err)
    assert len(lines) == 1, err
    assert f"--checkpoint_dir {url} is in use by another run" in lines[0]
    assert "--output_dir /elsewhere/run, pid 4242" in lines[0] and f"delete {url}/.lock" in lines[0]
    assert "Traceback" not in err
    assert _keys(s3, prefix) == [".lock"]  # nothing written, the other run's lock untouched
    assert not (out / "summary.json").exists()


def test_a_missing_bucket_is_one_line_naming_the_operation(s3, tmp_path, capfd):
    url = "s3://no-such-bucket/run"
    assert main_ranks([*STORE_ARGS, "--max_steps", "4", "--output_dir", str(tmp_path / "run"),
                       "--checkpoint_dir", url]) == [2, 2]
    err = capfd.readouterr().err
    lines = error_lines(err)
    assert len(lines) == 1 and f"--checkpoint_dir {url}: the store refused a lock" in lines[0], err
    assert "Traceback" not in err


def test_a_file_url_store_seals_prunes_and_locks_like_a_bucket(reference, tmp_path, capfd):
    """``file://``: the store's code on a local folder; the lock is an ``xb`` open. The reference run's: 10 steps,
    --keep_last 2, its --output_dir a ``file://`` URL as well (the local folder)."""
    store, out = tmp_path / "store", tmp_path / "run"
    shutil.copytree(reference / "store", store)
    shutil.copytree(reference / "run", out)
    assert read_summary(out)["optimizer_steps"] == 10  # --output_dir file://PATH wrote PATH
    assert sorted(os.listdir(store)) == ["step_00000008", "step_00000010"]  # pruned after each seal; lock gone
    assert (store / "step_00000010" / "checkpoint.json").is_file()
    assert not (out / "checkpoints" / "step_00000010").exists()
    (store / ".lock").write_text(json.dumps({"host": "node7", "output_dir": str(out), "pid": 1, "since": "then"}))
    capfd.readouterr()
    args = [*STORE_ARGS, "--keep_last", "2", "--output_dir", str(out), "--checkpoint_dir", f"file://{store}"]
    assert main_ranks([*args, "--max_steps", "12", "--resume_from_checkpoint", "auto"]) == [2, 2]
    lines = error_lines(capfd.readouterr().err)
    assert len(lines) == 1 and "is in use by another run" in lines[0] and "host node7" in lines[0]


def test_async_saves_to_the_store_resume_bitwise_after_a_kill(s3, reference, tmp_path):
    """--async_checkpointing: the upload and the seal run in the writer thread; the job SIGKILLed after step 5
    (step 4's upload done or not) resumes from the newest sealed checkpoint to the uninterrupted run's weights."""
    prefix, out = new_prefix(), tmp_path / "run"
    args = [*STORE_ARGS, "--max_steps", "10", "--output_dir", str(out), "--checkpoint_dir", f"s3://{BUCKET}/{prefix}",
            "--async_checkpointing"]

    with pytest.raises(RankFailed, match="exited with code -9"):
        run_ranks(lambda: faults.main_signalled_after(args, 5, signal.SIGKILL))
    sealed = _sealed_steps(s3, prefix)
    assert sealed in ([2], [2, 4])
    assert main_ranks([*args, "--resume_from_checkpoint", "auto"]) == [0, 0]
    assert read_summary(out)["resumed_from_step"] == sealed[-1]
    _assert_same_weights(out, reference)
    assert _sealed_steps(s3, prefix) == [*sealed, *(s for s in (4, 6, 8, 10) if s > sealed[-1])]


# ----------------------------------------------------------------- the lock, and failures of a store (file://)


class _NoConditionalCreate:
    """The file system of a store that ignores ``mode="create"`` (adlfs's ``_pipe_file`` drops it; some S3-compatible
    stores ignore If-None-Match), seen by a run whose look for the lock came just before the other run wrote it."""

    def __init__(self, fs):
        self._fs, self._looked = fs, False

    def __getattr__(self, name):
        return getattr(self._fs, name)

    def exists(self, path):
        if path.endswith("/.lock") and not self._looked:
            self._looked = True
            return False
        return self._fs.exists(path)

    def pipe_file(self, path, value, mode="overwrite", **kwargs):
        return self._fs.pipe_file(path, value, **kwargs)


def _ranks_before_seal(args: list[str], step: int, before) -> list[int]:
    """The CLI on 2 forked ranks; ``before(store)`` on the main process as it starts to seal ``step``."""
    def rank() -> int:
        from accel_ddp.checkpoint import storage
        from accel_ddp.cli.train import main

        seal = storage.ObjectStore.seal

        def hooked(self, tmp, final, meta):
            if final.endswith(f"step_{step:08d}"):
                before(self)
            return seal(self, tmp, final, meta)

        storage.ObjectStore.seal = hooked
        return main(args)

    return run_ranks(rank)


def _sealed_folder(store, step: int) -> None:
    folder = store / f"step_{step:08d}"
    folder.mkdir(parents=True)
    (folder / "checkpoint.json").write_text("{}")


def test_a_run_whose_lock_a_later_run_overwrote_stops_before_its_next_seal_or_deletion(tmp_path):
    from accel_ddp.checkpoint.storage import ObjectStore
    from accel_ddp.checkpoint.store_calls import StoreError

    store, first, second = tmp_path / "store", tmp_path / "first", tmp_path / "second"
    first.mkdir()
    second.mkdir()
    url = f"file://{store}"
    a = ObjectStore(url, str(first / "checkpoints"))
    a.claim(str(first))
    b = ObjectStore(url, str(second / "checkpoints"))
    b.fs = _NoConditionalCreate(b.fs)
    b.claim(str(second))  # it overwrote a's lock, and its read-back sees its own: nothing a store can tell
    _sealed_folder(store, 2)  # b's checkpoint
    (tmp_path / "tmp").mkdir()
    (tmp_path / "tmp" / "model.safetensors").write_text("a's weights")
    with pytest.raises(StoreError, match=rf"--checkpoint_dir {url}: this run lost its lock {url}/.lock \(host "
                                         rf"\S+, --output_dir {second}, pid {os.getpid()}\)"):
        a.seal(str(tmp_path / "tmp"), a.folder(4), {"step": 4})
    with pytest.raises(StoreError, match="lost its lock"):
        a.remove(a.folder(2))
    assert sorted(os.listdir(store)) == [".lock", "step_00000002"]  # b's lock and checkpoint untouched
    a.release()  # not ours any more: left in place
    assert json.loads((store / ".lock").read_text())["output_dir"] == str(second)


def test_the_first_run_stops_with_one_line_at_its_seal_instead_of_pruning_the_other_runs_checkpoints(tmp_path, capfd):
    """2 ranks, --keep_last 1: after step 2 is sealed, another run overwrites the lock (a store without the conditional
    create) and seals a checkpoint of its own; without the check, step 4's prune would delete it and step 2."""
    store, out = tmp_path / "store", tmp_path / "run"
    url = f"file://{store}"
    args = [*STORE_ARGS, "--max_steps", "8", "--keep_last", "1", "--output_dir", str(out), "--checkpoint_dir", url]
    other = {"host": "node7", "output_dir": "/elsewhere/run", "pid": 4242, "since": "then", "id": "theirs"}

    def the_other_run_writes(_) -> None:
        (store / ".lock").write_text(json.dumps(other))
        _sealed_folder(store, 1)

    assert _ranks_before_seal(args, 4, the_other_run_writes) == [2, 2]
    err = capfd.readouterr().err
    lines = error_lines(err)
    assert len(lines) == 1, err
    assert f"this run lost its lock {url}/.lock (host node7, --output_dir /elsewhere/run" in lines[0]
    assert "Traceback" not in err
    assert sorted(os.listdir(store)) == [".lock", "step_00000001", "step_00000002"]
    assert json.loads((store / ".lock").read_text()) == other


def test_a_lock_of_this_host_and_path_is_taken_over_only_from_the_same_folder(tmp_path, capsys):
    """Two containers can share a host name and a path on different file systems: the folder's id decides."""
    from accel_ddp.checkpoint.storage import ObjectStore
    from accel_ddp.checkpoint.store_calls import StoreError

    store, out = tmp_path / "store", tmp_path / "run"
    store.mkdir()
    out.mkdir()
    url = f"file://{store}"
    left = {"host": socket.gethostname(), "output_dir": os.path.abspath(out), "pid": 1, "since": "then",
            "id": "the-other-containers-folder"}
    (store / ".lock").write_text(json.dumps(left))
    with pytest.raises(StoreError, match=rf"--checkpoint_dir {url} is in use by another run .* pid 1, since then"):
        ObjectStore(url, str(out / "checkpoints")).claim(str(out))
    assert json.loads((store / ".lock").read_text()) == left
    (out / ".store-claim").write_text("the-other-containers-folder\n")  # the folder that run wrote: it is dead
    ObjectStore(url, str(out / "checkpoints")).claim(str(out))
    assert f"taking over {url}/.lock, left by pid 1" in capsys.readouterr().out
    assert json.loads((store / ".lock").read_text())["pid"] == os.getpid()


def test_a_store_that_cannot_be_opened_is_one_line_before_the_data(tmp_path, monkeypatch, capfd):
    """adlfs raises ValueError building its file system without an account: one line, exit 2, nothing written."""
    import fsspec

    from accel_ddp import config

    class Unopenable(fsspec.AbstractFileSystem):
        protocol = "az"

        def __init__(self, *args, **kwargs):
            raise ValueError("Must provide either a connection_string or account_name with credentials!!\nsecond line")

    # fsspec.registry is also the name of the package's read-only view of it: the module, from sys.modules
    monkeypatch.setitem(importlib.import_module("fsspec.registry")._registry, "az", Unopenable)  # forks inherit it
    monkeypatch.setitem(config.STORE_PACKAGES, "az", ("fsspec", "azure"))
    url = "az://container/run"
    assert main_ranks([*ARGS, "--output_dir", str(tmp_path / "run"), "--checkpoint_dir", url]) == [2, 2]
    err = capfd.readouterr().err
    lines = error_lines(err)
    assert lines == [f"accel_ddp: error: --checkpoint_dir {url}: cannot open the store (ValueError: Must provide "
                     "either a connection_string or account_name with credentials!!); check its credentials and "
                     "settings"], err
    assert "Traceback" not in err
    assert not (tmp_path / "run").exists()  # before the output folder, hence before the data and prepare


def test_a_store_that_fails_mid_run_is_one_line_and_exit_1(tmp_path, capfd):
    """Its settings worked (the lock, step 2's upload): step 4's upload failing is a failure, not bad input."""
    store, out = tmp_path / "store", tmp_path / "run"
    url = f"file://{store}"
    args = [*STORE_ARGS, "--max_steps", "8", "--output_dir", str(out), "--checkpoint_dir", url]

    def unreachable(store) -> None:
        def put_file(*args, **kwargs):
            raise OSError("Could not connect to the endpoint URL")

        store.fs.put_file = put_file

    assert _ranks_before_seal(args, 4, unreachable) == [1, 1]
    err = capfd.readouterr().err
    lines = error_lines(err)
    assert len(lines) == 1 and f"--checkpoint_dir {url}: the store refused an upload (OSError: Could not connect" \
        in lines[0] and lines[0].endswith("then relaunch with --resume_from_checkpoint auto"), err
    assert "Traceback" not in err
    assert sorted(os.listdir(store)) == ["step_00000002"]  # the lock released, step 4 never sealed


def test_a_full_local_disk_during_a_download_is_named_as_such(tmp_path):
    from accel_ddp.checkpoint.storage import ObjectStore
    from accel_ddp.outputs.files import WriteFailed

    store, out = tmp_path / "store", tmp_path / "run"
    _sealed_folder(store, 2)
    s = ObjectStore(f"file://{store}", str(out / "checkpoints"))

    def get_file(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    s.fs = _NoConditionalCreate(s.fs)
    s.fs.get_file = get_file
    with pytest.raises(WriteFailed, match=rf"cannot download file://{store}'s checkpoint into .*: the file system is "
                                          "full .*; free space there"):
        s.local_copy(s.folder(2))
