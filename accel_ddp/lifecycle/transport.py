"""What gloo and NCCL say when a peer rank went away or stopped answering: one table, and the two questions
:mod:`accel_ddp.lifecycle.failure` asks of an error (``lost_peer``: the peer's process or connection ended;
``stopped_peer``: it did not answer within the process group's timeout).

Every message was read from the installed torch 2.14 (``strings`` of torch/lib/libtorch_cpu.so, where gloo is
built in, and of torch/lib/libtorch_cuda.so, ProcessGroupNCCL's and NCCL's result strings) and its sources:

- gloo/transport/tcp/pair.cc: a read of 0 bytes is "Connection closed by peer"; a failed ``read``/``write`` is
  "Read error"/"Write error" followed by ``strerror``: "Connection reset by peer" (ECONNRESET), "Broken pipe"
  (EPIPE); "Socket closed" for an operation on a pair already closed.
- gloo/transport/tcp/unbound_buffer.cc (``waitRecv``, ``waitSend``): an operation past the group's timeout raises
  "Timed out waiting <N>ms for recv operation to complete" (or send) and first signals every pair of its context,
  so every other operation in flight fails with "Application timeout caused pair closure": a larger model's DDP
  all-reduce has several buckets in flight, and which of them surfaces first is a race (issue 50: 1 run in 3).
- torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp: "Watchdog caught collective operation timeout" and "NCCL
  operation timed out" (a collective past its timeout), "NCCL communicator was aborted on rank N" / "after a
  previous error" (the watchdog aborted it, mostly because a peer failed), "remote error detected from rank";
  NCCL's own ``ncclRemoteError``: "A call failed possibly due to a network error or a remote process exiting
  prematurely", and ``ncclSystemError`` (a socket call failed: a peer's connection gone).

Each row is tested (tests/lifecycle/test_transport.py); the gloo timeout and the pair closure are provoked there on
a real gloo group, a closed connection by tests/lifecycle/test_failure.py's killed ranks, a stopped rank under a
small and a larger model by tests/lifecycle/test_red_team.py::test_t9_*. NCCL's need two GPUs: not provoked.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

LOST = "lost"  # the peer's process or its connection ended (killed, crashed, failed and exited)
STOPPED = "stopped"  # the peer did not answer within the group's timeout (stopped, hung, far slower)


@dataclass(frozen=True)
class PeerMessage:
    """One message of a transport about a peer: its words (a regular expression), the backend and what it means."""

    words: str
    backend: str  # "gloo", "nccl" or "store"
    kind: str  # LOST or STOPPED
    source: str  # where the transport writes it


PEER_MESSAGES = (
    PeerMessage("Connection closed by peer", "gloo", LOST, "gloo/transport/tcp/pair.cc"),
    PeerMessage("Connection reset by peer", "gloo", LOST, "gloo/transport/tcp/pair.cc (strerror(ECONNRESET))"),
    PeerMessage("Broken pipe", "gloo", LOST, "gloo/transport/tcp/pair.cc (strerror(EPIPE))"),
    PeerMessage("Socket closed", "gloo", LOST, "gloo/transport/tcp/pair.cc"),
    PeerMessage(r"Timed out waiting (?P<ms>\d+)ms for (recv|send)", "gloo", STOPPED,
                "gloo/transport/tcp/unbound_buffer.cc"),
    PeerMessage("Application timeout caused pair closure", "gloo", STOPPED, "gloo/transport/tcp/unbound_buffer.cc"),
    PeerMessage("NCCL communicator was aborted", "nccl", LOST, "torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp"),
    PeerMessage("remote error detected from rank", "nccl", LOST, "torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp"),
    PeerMessage("remote process exiting prematurely", "nccl", LOST, "NCCL's ncclRemoteError (ncclGetErrorString)"),
    PeerMessage("ncclSystemError", "nccl", LOST, "NCCL's ncclSystemError: a socket call failed"),
    PeerMessage(r"Watchdog caught collective operation timeout.*?Timeout\(ms\)=(?P<ms>\d+)|Watchdog caught "
                "collective operation timeout", "nccl", STOPPED, "torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp"),
    PeerMessage("NCCL operation timed out", "nccl", STOPPED, "torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp"),
)


@dataclass(frozen=True)
class Said:
    """What an error's text said of a peer: the row, the words as they appear, and the timeout when it names one."""

    message: PeerMessage
    text: str
    timeout_s: float | None


def peer_message(text: str, kind: str | None = None) -> Said | None:
    """The first row of :data:`PEER_MESSAGES` (of ``kind``, if given) found in ``text``, or None."""
    for row in PEER_MESSAGES:
        if kind is not None and row.kind != kind:
            continue
        found = re.search(row.words, text, re.DOTALL)
        if found:
            ms = found.groupdict().get("ms")
            return Said(row, found.group(0), int(ms) / 1000 if ms else None)
    return None
