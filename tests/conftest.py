"""The suite's fixtures and hooks; the helpers every test shares are in tests/helpers/ (no test module imports
another).

The process that runs tests imports torch, Accelerate and accel_ddp once, in ``pytest_configure`` here, so that the
ranks forked by ``tests.helpers.multiproc.run_ranks`` start with everything loaded (xdist's controller skips them).

The suite tests CPU semantics, also on a GPU machine: before torch loads, ``tests.helpers.env`` hides every GPU
(``CUDA_VISIBLE_DEVICES=''``), so forked ranks and launches see none. Tests that need a GPU opt in with
``@pytest.mark.gpu``, run their work in a subprocess with ``gpu_env()`` (the GPUs the machine offered), and are
skipped where there is none (``pytest -m gpu`` runs only them).
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import tempfile
from pathlib import Path

import tests.helpers.env  # noqa: F401 - first: the GPUs hidden and the thread variables set before torch loads

# isort: split

import pytest  # noqa: E402

from tests.helpers.runs import gpu_count  # noqa: E402

_PLOT = None  # RunRecorder.plot, which writes curves.png; see _no_curves_png
_WRITE_BYTECODE = pytest.StashKey[bool]()


def pytest_configure(config):
    """The process that runs tests imports torch, Accelerate and the package before any test module, once, so that
    every rank forked from it starts with them loaded. pytest-xdist's controller runs no test and collects none:
    it skips them (~4.5 s of CPU of a suite of ~300)."""
    if not _runs_tests(config):
        return
    global _PLOT
    import datasets  # noqa: F401 - Accelerate imports it to prepare any DataLoader: 1.6 s per rank otherwise
    import matplotlib.figure  # noqa: F401 - curves.png on every main process
    import torch._dynamo  # noqa: F401 - torch.optim imports it on first use: ~2 s once here, not per rank
    import tqdm

    try:  # every dataset builder imports scipy.io where it is installed (datasets/streaming.py patches its loadmat for
        import scipy.io  # noqa: F401 - each builder, builder.py): ~170 modules, ~0.2 s of CPU per rank otherwise
    except ImportError:
        pass

    # No tqdm monitor thread in the test process: the first progress bar (datasets' own, building test data) would
    # start one that runs until the process ends, and every rank forked later would inherit its locks mid-use.
    tqdm.tqdm.monitor_interval = 0

    import accel_ddp.loop  # torch, Accelerate and the package, for every forked rank

    _PLOT = accel_ddp.tracking.recorder.RunRecorder.plot
    _scan_backend_entry_points_once()

    # PYTHONDONTWRITEBYTECODE (set on this project's machines) also stops pytest caching the test modules it
    # rewrites for its assertions, so every worker of every run rewrote ~200 modules from source: ~3.4 s each.
    # Bytecode is written while the tests are collected (after the imports above), and the setting is restored
    # once they are.
    config.stash[_WRITE_BYTECODE] = sys.dont_write_bytecode
    sys.dont_write_bytecode = False


def _scan_backend_entry_points_once() -> None:
    """torch looks for a plugin of the backend at every process group's start, gloo included, by reading the entry
    points of every installed package (``Backend._ensure_backend_registered``): ~18 ms of CPU a rank, in each of the
    suite's hundreds of forked runs. What is installed does not change while the suite runs, so each backend is looked
    up once, here or in the first rank that asks, and every rank forked later inherits the answer. (A plugin found
    registers itself in ``Backend._plugins``, which torch checks first; a backend without one has nothing to find.)"""
    from torch.distributed import Backend

    lookup = getattr(Backend, "_ensure_backend_registered", None)  # a torch without it scans nothing
    if lookup is None:
        return
    looked_up: set[str] = set()

    def once(name: str) -> None:
        if name.lower() not in looked_up:
            lookup(name)
            looked_up.add(name.lower())

    once("gloo")
    Backend._ensure_backend_registered = staticmethod(once)


def _runs_tests(config) -> bool:
    """False in pytest-xdist's controller, which runs no test and collects none; True in a worker or under -n 0."""
    return os.environ.get("PYTEST_XDIST_WORKER") is not None or not getattr(config.option, "numprocesses", None)


def pytest_xdist_auto_num_workers(config):
    """``-n auto`` (pyproject.toml's addopts): a worker per core, at most 4. Each worker holds torch and the package
    (~0.8 GB) and forks 2-rank groups and launches; past a few workers the cores, not the workers, are the limit."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(cores, 4))


def pytest_collection_modifyitems(config, items):
    gpu_tests = [item for item in items if item.get_closest_marker("gpu")]
    if gpu_tests and gpu_count() == 0:
        skip = pytest.mark.skip(reason="needs a CUDA GPU (none usable here); the rest of the suite runs on the CPU")
        for item in gpu_tests:
            item.add_marker(skip)



@pytest.fixture(scope="session", autouse=True)
def _no_curves_png():
    """Forked runs leave out curves.png: ~0.3 s of Agg rendering on the main rank at the end of each of ~90 runs
    that no assertion looks at (a failed plot only warns). Tests marked ``curves`` plot; launched runs always do."""
    from accel_ddp.tracking.recorder import RunRecorder

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(RunRecorder, "plot", lambda self: None)
        yield


@pytest.fixture(autouse=True)
def _curves_png_where_marked(request, _no_curves_png):
    """``@pytest.mark.curves``: the test reads or lists curves.png, or breaks the plot on purpose."""
    if request.node.get_closest_marker("curves") is None:
        yield
        return
    from accel_ddp.tracking.recorder import RunRecorder

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(RunRecorder, "plot", _PLOT)
        yield


@pytest.fixture(autouse=True)
def _library_log_handlers_outlive_the_test():
    """Transformers makes its log handler on first use, on whatever ``sys.stderr`` is then: inside a test, the
    test's capture, closed when the test ends. A later test's forked ranks would log into the closed file ("I/O
    operation on closed file" tracebacks on stderr). After each test the handler writes to the process's stderr."""
    yield
    hf_logging = sys.modules.get("transformers.utils.logging")
    if hf_logging is not None:
        for handler in hf_logging._get_library_root_logger().handlers:
            if type(handler) is logging.StreamHandler:  # its own, not a capture handler of pytest
                handler.stream = sys.__stderr__  # not setStream: it flushes the closed one first
                handler.__dict__.pop("flush", None)  # Transformers bound the capture's flush to it


@pytest.fixture
def launcher_store():
    """A TCPStore as torchrun's agent hosts it, and the environment it gives its workers to share it."""
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    env = {"TORCHELASTIC_USE_AGENT_STORE": "True", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port),
           "TORCHELASTIC_RUN_ID": "test", "TORCHELASTIC_RESTART_COUNT": "0"}
    yield store, env


@pytest.fixture
def open_dir():
    """A folder an unprivileged child can reach (pytest's own tmp folders are private to root)."""
    path = Path(tempfile.mkdtemp(prefix="accel_ddp_tests_"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def _s3_server():
    """moto's S3 server with the bucket tests.helpers.s3.BUCKET, started once per pytest process (~1.7 s of CPU each
    start); a boto3 client of it and the environment that reaches it."""
    from tests.helpers.s3 import s3_server

    with s3_server() as (client, _, env):
        yield client, env


@pytest.fixture
def s3(_s3_server, monkeypatch):
    """A boto3 client of moto's S3 server; the environment s3fs reads its endpoint and keys from is set for this test
    (the forked ranks inherit it), and only for tests that ask for the server."""
    client, env = _s3_server
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    return client


@pytest.fixture(scope="session", autouse=True)
def _quick_stream_ends():
    """datasets sleeps 5 s whenever a shuffled parquet stream's reader threads end (apache/arrow#45214): seconds of
    a streaming test's wall time per pass. A fraction of a second is plenty for the tests' tiny files. Every test
    gets it (forked ranks inherit it): a test's time does not depend on whether it asked or what ran before it."""
    import datasets.config

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(datasets.config, "SLEEP_TIME_ON_THREADS_SHUTDOWN", 0.2)
        yield


@pytest.fixture
def tiny_args() -> list[str]:
    """A synthetic run that takes a couple of seconds."""
    return ["--dataset", "synthetic", "--synthetic_samples", "256", "--synthetic_shape", "1", "8", "8",
            "--model", "mlp", "--hidden_size", "32", "--global_batch_size", "32", "--epochs", "2"]


@pytest.fixture
def quick_orphan_workers(monkeypatch):
    """A DataLoader worker notices its rank died every 5 s (torch's MP_STATUS_CHECK_INTERVAL); until it exits
    it holds the dead rank's gloo sockets, which it inherited, so the other rank's collective fails only then.
    Forked ranks and their workers inherit this 0.2 s: a failed rank's peer stops within a second, not after 5."""
    import torch.utils.data._utils.worker

    monkeypatch.setattr(torch.utils.data._utils.worker, "MP_STATUS_CHECK_INTERVAL", 0.2)


def pytest_collection_finish(session):
    """Everything loaded so far (torch, dynamo, Accelerate, transformers, the collected tests) is moved out of the
    garbage collector's sight: a full collection in the test process, or in a rank forked from it, no longer walks
    those ~450k objects that live until the process ends (measured: 5-8% of a module's wall time). Only
    this process's own objects are frozen; what the tests create is collected as before."""
    if not _runs_tests(session.config):
        return
    sys.dont_write_bytecode = session.config.stash[_WRITE_BYTECODE]
    import gc

    gc.collect()
    gc.freeze()
