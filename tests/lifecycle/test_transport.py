"""Every message gloo or NCCL may raise for a peer that went away or stopped answering is named as such, in one line
(issue 50 item 4): accel_ddp/lifecycle/transport.py's table, row by row, as the ranks' errors carry them."""

from __future__ import annotations

import pytest

from accel_ddp.lifecycle import failure
from accel_ddp.lifecycle.transport import LOST, PEER_MESSAGES, STOPPED

# Each row's message as torch raises it (the gloo ones as seen on this machine; the NCCL ones as ProcessGroupNCCL.cpp
# and NCCL's ncclGetErrorString compose them).
RAISED = {
    "Connection closed by peer": "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:561] Connection closed by "
                                 "peer [127.0.0.1]:48512. This is typically caused by a remote worker crashing.",
    "Connection reset by peer": "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:545] Read error "
                                "[127.0.0.1]:45954: Connection reset by peer. This is typically caused by a remote "
                                "worker hanging or bugs in the application.",
    "Broken pipe": "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:600] Write error [127.0.0.1]:1234: Broken "
                   "pipe",
    "Socket closed": "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:370] Socket closed",
    r"Timed out waiting (?P<ms>\d+)ms for (recv|send)": "[/pytorch/third_party/gloo/gloo/transport/tcp/"
                                                        "unbound_buffer.cc:81] Timed out waiting 15000ms for recv "
                                                        "operation to complete",
    "Application timeout caused pair closure": "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:612] "
                                               "Application timeout caused pair closure",
    "NCCL communicator was aborted": "NCCL communicator was aborted on rank 0.",
    "remote error detected from rank": "[Rank 0] remote error detected from rank: 1",
    "remote process exiting prematurely": "NCCL error in: ProcessGroupNCCL.cpp:3356, remote process exited or there "
                                          "was a network error, NCCL version 2.27.3\nncclRemoteError: A call failed "
                                          "possibly due to a network error or a remote process exiting prematurely.",
    "ncclSystemError": "NCCL error in: ProcessGroupNCCL.cpp:3356, unhandled system error, NCCL version 2.27.3\n"
                       "ncclSystemError: System call (e.g. socket, malloc) or external library call failed or device "
                       "error.",
    "Watchdog caught collective operation timeout": "[Rank 0] Watchdog caught collective operation timeout: "
                                                    "WorkNCCL(SeqNum=12, OpType=ALLREDUCE, NumelIn=1, NumelOut=1, "
                                                    "Timeout(ms)=15000) ran for 15032 milliseconds before timing out.",
    "NCCL operation timed out": "[Rank 1] NCCL operation timed out",
}


def _raised(row) -> str:
    key = next(key for key in RAISED if key in row.words or row.words.startswith(key))
    return RAISED[key]


def test_every_row_has_a_message_as_raised():
    assert len({_raised(row) for row in PEER_MESSAGES}) == len(PEER_MESSAGES)


@pytest.mark.parametrize("row", PEER_MESSAGES, ids=lambda row: f"{row.backend}: {row.words[:40]}")
def test_each_transport_message_of_a_peer_is_named_in_one_line_not_a_traceback(row, monkeypatch):
    err = RuntimeError(_raised(row))
    monkeypatch.setattr(failure, "launch_rank", lambda: 1)
    text = failure._report_text(err, 1)
    assert text.startswith("accel_ddp: error: rank 1") and "Traceback" not in text and text.count("\n") <= 1, text
    if row.kind == LOST:
        assert failure.lost_peer(err) and "lost its connection to another rank" in text, text
    else:
        assert row.kind == STOPPED and failure.timed_out(err) and not failure.lost_peer(err)
        assert "another rank did not answer within --ddp_timeout" in text, text
    if "15000" in _raised(row):
        assert "--ddp_timeout 15 s" in text, text


def test_a_peer_message_makes_a_peers_failure_a_peer_failed_naming_it():
    made = failure.Claim(rank=1, world_size=2, first={"rank": 0, "code": 1, "message": "OSError: disk gone"})
    for row in PEER_MESSAGES:
        named = failure.peer_named(RuntimeError(_raised(row)), made)
        assert isinstance(named, failure.PeerFailed) and named.rank == 0
        assert str(named).startswith("rank 0 failed: OSError: disk gone;"), named
    assert failure.peer_named(ValueError("its own bug"), made).args == ("its own bug",)


def _real_gloo_messages(seen_both: str) -> dict[str, str] | None:
    """On forked ranks of a gloo group with a 200 ms timeout: rank 0 runs an all-reduce that rank 1 never joins; it
    times out ("Timed out waiting 200ms for recv"), which closes every pair of the context, so the next one fails at
    once with "Application timeout caused pair closure" (gloo/transport/tcp/unbound_buffer.cc ``waitRecv``). Rank 0
    returns each error's text, then writes the file ``seen_both``, which rank 1 waits for: it leaves no sooner (a
    peer that exited gives "Connection closed by peer" instead, as tests/lifecycle/test_failure.py's killed ranks
    show) and no later than needed. The ranks meet on a store of their own with a minute's timeout: the group's
    200 ms bounds its collectives only, not the ranks' start-up."""
    import os
    import time
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), 2, is_master=rank == 0,
                          timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timedelta(milliseconds=200))
    if rank == 1:
        deadline = time.monotonic() + 50
        while not os.path.exists(seen_both) and time.monotonic() < deadline:  # joins nothing until rank 0 has seen
            time.sleep(0.05)                                                   # both errors
        return {}
    seen = {}
    for name in ("timeout", "pair_closure"):  # the second starts once the first has failed: the pairs are closed
        try:
            dist.all_reduce(torch.ones(4))
        except RuntimeError as err:
            seen[name] = str(err)
    open(seen_both, "w").close()
    return seen


def test_gloos_timeout_and_pair_closure_as_raised_are_named_as_a_stopped_peer(tmp_path):
    from tests.helpers.multiproc import run_ranks

    seen = run_ranks(lambda: _real_gloo_messages(str(tmp_path / "seen_both")), world_size=2, timeout=60)[0]
    assert "Timed out waiting 200ms for recv" in seen["timeout"], seen
    assert "Application timeout caused pair closure" in seen["pair_closure"], seen
    for text in seen.values():
        err = RuntimeError(text)
        assert failure.timed_out(err) and not failure.lost_peer(err)
        assert "did not answer within --ddp_timeout" in failure._report_text(err, 1)
