"""The other ranks of a failing launch: the store every rank reaches, and this rank's connections to them.

Used by :mod:`accel_ddp.lifecycle.failure` only, on the way out; nothing here runs while a run trains.

The store (``rank_store``). torchrun's own where it shares it with its workers
(``TORCHELASTIC_USE_AGENT_STORE=True`` at MASTER_ADDR:MASTER_PORT: the ``static`` rendezvous always,
``c10d`` unless ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``; torch/distributed/elastic/rendezvous/
static_tcp_rendezvous.py and dynamic_rendezvous.py ``use_agent_store``, agent/server/
local_elastic_agent.py ``_start_workers``); it lives as long as the launcher. Otherwise the process
group's: over ``env://`` rank 0 hosts a TCPStore server at MASTER_ADDR:MASTER_PORT and the others
are its clients (torch/distributed/rendezvous.py ``_create_c10d_store``), so it lives as long as
rank 0's process. Before the group exists, rank 0 hosts one there itself (nothing listens on that
port before the group's) and the others connect to it.

A store whose server is gone answers with a C++ warning and its stack on stderr before the error,
and a client that cannot connect logs one per retry: so the port is first probed with a plain
socket, silently.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
from datetime import timedelta
from typing import Any

PROBE_S = 0.2  # how long a probe of the store's port waits for a reset from a server that is dying
STORE_TIMEOUT_S = 10.0  # before the group exists: how long to look for rank 0's store (it may be slower to fail)


def rank_store(rank: int, lost_peer: bool) -> tuple[Any, bool] | None:
    """The store every rank of this launch reaches, and whether this process hosts it; None without one.

    ``lost_peer``: this rank's error says another rank went away, maybe rank 0 with its store: look once.
    """
    import torch.distributed as dist

    addr, port_text = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT", "")
    port = int(port_text) if port_text.isdigit() else None
    shared = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    if not shared and dist.is_available() and dist.is_initialized():
        if rank != 0 and lost_peer and addr and port and not listening(addr, port, 0.0):
            return None
        return dist.distributed_c10d._get_default_store(), rank == 0  # env:// puts its server on rank 0
    if not (addr and port):
        return None
    if not shared and rank == 0 and (store := _tcp_store(addr, port, host=True)) is not None:
        return store, True
    if not listening(addr, port, 0.0 if lost_peer else STORE_TIMEOUT_S):
        return None
    store = _tcp_store(addr, port, host=False)
    return None if store is None else (store, False)


def listening(addr: str, port: int, seconds: float) -> bool:
    """Does a server accept connections at ``addr:port`` within ``seconds``? (A plain socket: no log lines.)

    A connection the kernel queued for a process that is dying is reset when its listening socket
    closes: the probe waits ``PROBE_S`` for that (a TCPStore server sends nothing first).
    """
    deadline = time.monotonic() + seconds
    while True:
        try:
            with socket.create_connection((addr, port), timeout=1.0) as probe:
                probe.settimeout(PROBE_S)
                try:
                    return probe.recv(1) != b""
                except TimeoutError:
                    return True
        except OSError:  # refused, reset
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)


def _tcp_store(addr: str, port: int, host: bool):
    from torch.distributed import TCPStore

    try:  # DistStoreError and DistNetworkError are RuntimeErrors
        return TCPStore(addr, port, is_master=host, wait_for_workers=False, timeout=timedelta(seconds=STORE_TIMEOUT_S))
    except RuntimeError:
        return None


def close_peer_connections(only: frozenset[str] | None = None) -> int:
    """Shut down this process's TCP connections, all but the store's (at MASTER_PORT); how many (Linux; else 0).
    ``only``: those among them (``/proc/self/fd`` link names, ``socket:[inode]``), e.g. :func:`group_connections`.

    The other ranks' collectives with this rank then fail at once (gloo: "Connection closed by peer"),
    as they would at its exit, and they report. Before that they could not: a process group's
    sockets stay open until its last reference goes (the DDP model holds one, so
    ``destroy_process_group`` leaves them open), and DataLoader workers forked after the group
    formed hold copies of them (closing an fd sends nothing while a copy is open; ``shutdown`` does).
    For a process about to exit: its exit closes these connections anyway.
    """
    keep = int(os.environ.get("MASTER_PORT", "") or -1)
    closed = 0
    for name, link in _sockets():
        if only is not None and link not in only:
            continue
        try:
            sock = socket.socket(fileno=int(name))
        except OSError:  # gone meanwhile (the listing's own fd), or not a socket
            continue
        try:
            if sock.family in (socket.AF_INET, socket.AF_INET6) and sock.type == socket.SOCK_STREAM \
                    and keep not in (sock.getsockname()[1], sock.getpeername()[1]):
                sock.shutdown(socket.SHUT_RDWR)
                closed += 1
        except OSError:  # a listening socket has no peer
            pass
        finally:
            sock.detach()  # the fd stays its owner's (gloo's) to close
    return closed


def _sockets() -> list[tuple[str, str]]:
    """(fd, ``socket:[inode]``) of this process's open sockets (Linux; else none)."""
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return []
    found = []
    for name in names:
        with contextlib.suppress(OSError):  # gone meanwhile (the listing's own fd)
            if (link := os.readlink(f"/proc/self/fd/{name}")).startswith("socket:"):
                found.append((name, link))
    return found


_GROUP: dict[str, frozenset[str]] = {"sockets": frozenset()}


@contextlib.contextmanager
def group_forming():
    """Around the process group's formation: note the sockets it opened (gloo's listener and its connections to
    each peer; gloo connects the full mesh as the group forms), for :func:`group_connections`."""
    before = {link for _, link in _sockets()}
    yield
    _GROUP["sockets"] = frozenset(link for _, link in _sockets() if link not in before)


def group_connections() -> frozenset[str]:
    """The sockets the current process group opened (by inode: a number another file took since is not one of
    them): what a caller's process may shut down to end its group's collectives, and nothing of the caller's."""
    return _GROUP["sockets"]
