"""A DataLoader worker killed at any moment is restarted, and the same batches follow (issue 50 item 3).

A worker's batch reaches the rank as shared file descriptors: unpickling each tensor's storage connects to the
worker's ``multiprocessing.resource_sharer`` and receives the descriptor there (torch/multiprocessing/reductions.py
``rebuild_storage_fd``, ``DupFd.detach`` in multiprocessing/resource_sharer.py). A worker that dies in that exchange
shows in the rank as one of several errors, each provoked here deterministically by a hook on the rank's side of it:

- killed before the rank connects: the connection is refused (``ConnectionRefusedError``);
- killed with the rank's request unread: ``ConnectionResetError``;
- dead after reading the request, before it answered: ``EOFError`` from ``recv_handle`` (the flake of
  test_red_team.py's T8 case, the worker killed in the SIGHUP resume; the closed connection is a socket pair's
  closed end here, as a worker's death between the two cannot be timed from outside);
- killed between two batches, before the rank asks for the next one: torch's own "DataLoader worker (pid N) exited
  unexpectedly" (``RuntimeError``), found at the next read.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.resource_sharer as resource_sharer
import os
import signal
import time
from multiprocessing.connection import Client
from multiprocessing.process import current_process

import pytest
from torch.utils.data.dataloader import _MultiProcessingDataLoaderIter

from accel_ddp.data.host_loader import HostLoader
from tests.helpers.data import IndexDataset


def _loader() -> HostLoader:
    return HostLoader(IndexDataset(48), 4, 4, seed=5, num_workers=1)


def _batches(loader: HostLoader) -> list[list[int]]:
    loader.set_epoch(0)
    return [x.flatten().int().tolist() for x, _ in loader]


def _worker_pid(loader: HostLoader) -> int:
    return loader.loader._iterator._workers[0].pid


def _killed(pid: int) -> None:
    """SIGKILL ``pid`` and wait until it is gone (a zombie counts: its sockets are closed)."""
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as stat:
                if stat.read().split(") ")[1][0] in "ZX":
                    return
        except FileNotFoundError:
            return
        time.sleep(0.01)
    raise AssertionError(f"worker {pid} still alive")


def _seen_alive_once(loader: HostLoader) -> None:
    """The worker's next ``is_alive()`` says True: as when the rank meets the closed connection before the kernel has
    made the dying worker a zombie (its sockets close first), so torch's own check of its workers (``_try_get_data``
    turns an error into "DataLoader worker exited unexpectedly" only for a worker already seen dead) passes the raw
    error on, as in the flake."""
    worker = loader.loader._iterator._workers[0]
    real = worker.is_alive

    def is_alive() -> bool:
        worker.is_alive = real
        return True

    worker.is_alive = is_alive


def _kill_at(loader: HostLoader, monkeypatch, at: int, moment: str) -> list[int]:
    """Kill the loader's worker at the ``at``-th descriptor the rank fetches, at ``moment``; returns the pids."""
    original = resource_sharer._ResourceSharer.get_connection
    calls, killed = [0], []

    def get_connection(ident):
        calls[0] += 1
        if calls[0] != at:
            return original(ident)
        pid = _worker_pid(loader)
        killed.append(pid)
        if moment == "before_connect":
            _killed(pid)
            _seen_alive_once(loader)
            return original(ident)
        if moment == "before_reply":  # it read the request and died before it answered: the rank reads an end
            _killed(pid)
            _seen_alive_once(loader)
            ours, its = multiprocessing.Pipe()  # a socket pair, as the listener's: its end closed, unanswered
            its.close()
            return ours
        address, key = ident
        connection = Client(address, authkey=current_process().authkey)  # the worker's listener accepted it
        os.kill(pid, signal.SIGSTOP)  # it cannot read what follows ...
        connection.send((key, os.getpid()))
        _killed(pid)  # ... and dies with the request unread: the rank's read is reset
        _seen_alive_once(loader)
        return connection

    monkeypatch.setattr(resource_sharer._ResourceSharer, "get_connection", staticmethod(get_connection))
    return killed


@pytest.mark.parametrize("moment", ["before_connect", "request_unread", "before_reply"])
def test_a_worker_killed_while_the_rank_receives_its_batch_is_restarted_with_the_same_batches(moment, monkeypatch,
                                                                                          capfd):
    expected = _batches(_loader())
    loader = _loader()
    killed = _kill_at(loader, monkeypatch, at=7, moment=moment)  # batch 3's first tensor (two per batch)
    assert _batches(loader) == expected
    err = capfd.readouterr().err
    assert "Traceback" not in err and len(killed) == 1
    assert f"a DataLoader worker of rank 0 ended (pid {killed[0]}, killed by SIGKILL); started its workers again " \
           "at micro-batch 3 of epoch 0: the same batches follow" in err, err


def test_a_worker_killed_between_two_batches_is_restarted_with_the_same_batches(monkeypatch, capfd):
    # The rank waits for a batch in ``_try_get_data(self, timeout=_utils.MP_STATUS_CHECK_INTERVAL)`` and looks at its
    # workers each time that wait ends empty (torch/utils/data/dataloader.py): a default bound when torch was
    # imported, 5 s, which patching ``_utils.MP_STATUS_CHECK_INTERVAL`` does not reach. A worker killed with no batch
    # of it queued is found at the next read within 0.2 s instead.
    monkeypatch.setattr(_MultiProcessingDataLoaderIter._try_get_data, "__defaults__", (0.2,))
    expected = _batches(_loader())
    loader = _loader()
    loader.set_epoch(0)
    got, killed = [], None
    for micro_step, (x, _) in enumerate(loader):
        got.append(x.flatten().int().tolist())
        if micro_step == 4:
            killed = _worker_pid(loader)
            _killed(killed)
    assert got == expected
    err = capfd.readouterr().err
    assert f"(pid {killed}, killed by SIGKILL); started its workers again" in err, err


def test_each_way_a_worker_death_shows_is_one_the_loader_restarts_on():
    from accel_ddp.data.workers import WORKER_DEATH_ERRORS

    for error in (RuntimeError("DataLoader worker (pid 7) is killed by signal: Killed."), EOFError(),
                  ConnectionResetError(), ConnectionRefusedError(), BrokenPipeError(), FileNotFoundError()):
        assert isinstance(error, WORKER_DEATH_ERRORS), error
