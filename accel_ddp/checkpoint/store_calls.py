"""An object store's calls, each within its bound, and what a failed one says (``storage.py``'s ``ObjectStore``).

    StoreError     the store refused the run at its start (settings, credentials, its lock): exit 2
    StoreStalled   a call did not finish within --store_timeout, or a stop signal cut it: exit 2
    StoreFailed    the store failed a call once its lock was ours: exit 1
    BoundedCalls   ``_call``: the file system's method within its bound, a failure one line naming the store

No call waits forever (``--store_timeout`` T, docs/checkpoints.md "A store that stops answering"). A server
that accepts connections but never answers (stopped, not closed) hangs s3fs's PutObject for good: botocore
adds ``Expect: 100-continue`` and aiohttp's wait for the ``100 Continue`` is outside its ``sock_read``
timeout (measured against such a server: ``read_timeout=1`` bounded a GET, never a PUT). So every call of
an async file system (s3fs, gcsfs, adlfs: ``AsyncFileSystem``) runs its coroutine on the file system's loop
(what fsspec's ``sync`` does, fsspec/asyn.py) under our own deadline, T seconds plus 1 s per MiB it carries,
retries included, and is cancelled past it (``StoreStalled``: one line naming the store and the bound, exit 2
on every rank, as ``main_process_decides`` and the async saver's gather carry it). Inside that bound each
request of s3fs gets T/3 to connect and T/3 to answer (botocore ``Config(connect_timeout, read_timeout)``
through s3fs's ``config_kwargs``; s3fs's defaults are 5 s and 15 s) and botocore's standard retry mode 3
attempts; s3fs's own retry loop (``S3FileSystem.retries``, 5 by default, around botocore's own 5 legacy
attempts: up to 25 tries of 15 s per call) is cut to one. A stop signal (SIGTERM, SIGUSR1) that comes while
a call is under way cuts it ``STOP_GRACE_S`` later: torchrun SIGKILLs 30 s after its SIGTERM, and the run
must still stop with its line and exit code (``StopPoints.save``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections.abc import Callable
from typing import Any

from accel_ddp.util.messages import first_line
from accel_ddp.util.validation import ConfigError, ServiceFailure

DEFAULT_STORE_TIMEOUT = 60.0  # seconds: --store_timeout's default (config/options.py)
SECONDS_PER_MIB = 1.0  # a transfer's bound grows by this per MiB: a store slower than 1 MiB/s counts as stalled
REQUEST_ATTEMPTS = 3  # botocore's standard retry mode, each attempt within T / REQUEST_ATTEMPTS
STOP_GRACE_S = 5.0  # a call under way when a stop signal comes ends this much later at most
POLL_S = 0.1  # how often a waiting call looks at its deadline and for a stop signal


class StoreError(ConfigError):
    """The object store refused the run at its start (settings, credentials, a missing bucket, a lock another run
    holds or took): bad input, one line, exit 2."""


class StoreStalled(StoreError):
    """A call to the store did not finish within its bound (``--store_timeout``), or a stop signal cut it."""


class StoreFailed(ServiceFailure):
    """The object store failed an operation once its lock was ours (its settings worked): one line, exit 1."""


class BoundedCalls:
    """The calls of ``ObjectStore`` (its base): ``self.fs`` an fsspec file system, ``self.root`` the store's URL,
    ``self.timeout`` --store_timeout's seconds, ``self.stopping`` whether a stop signal came."""

    fs: Any
    root: str
    timeout: float
    stopping: Callable[[], bool]
    _stalled: bool  # a call ran past its bound
    _lock_data: bytes | None  # the lock object as we wrote it: from then on a failure is the store's, not the settings'

    def _call(self, what: str, method: str, *args: Any, passes: type[Exception] | tuple = (), nbytes: int = 0,
              **kwargs: Any) -> Any:
        """The file system's ``method(*args, **kwargs)`` within its bound (``nbytes``: what it carries); a failure of
        the store is one line naming it (``passes``: the errors the caller handles)."""
        try:
            if getattr(self.fs, "async_impl", False):
                return self._bounded(what, method, args, kwargs, nbytes)
            return getattr(self.fs, method)(*args, **kwargs)  # a local file system (file://) does not stall
        except Exception as err:
            if isinstance(err, (ConfigError, ServiceFailure, *(passes if isinstance(passes, tuple) else (passes,)))):
                raise
            raise self._failed(what, err) from None

    def _bounded(self, what: str, method: str, args: tuple, kwargs: dict, nbytes: int) -> Any:
        """``method``'s coroutine on the file system's loop, cancelled past ``--store_timeout`` plus 1 s per MiB,
        or ``STOP_GRACE_S`` after a stop signal that came while it ran: a StoreStalled either way."""
        started = time.monotonic()
        limit = self.timeout + nbytes / 2**20 * SECONDS_PER_MIB
        deadline, signalled = started + limit, self.stopping()  # a save after the signal (preemption's) runs in full
        future = asyncio.run_coroutine_threadsafe(getattr(self.fs, f"_{method}")(*args, **kwargs), self.fs.loop)
        while True:
            try:
                return future.result(timeout=POLL_S)
            except concurrent.futures.TimeoutError:
                if future.done():  # the call's own TimeoutError (asyncio's is the same class): the store's failure
                    raise
            now = time.monotonic()
            if not signalled and self.stopping():
                signalled, deadline = True, min(deadline, now + STOP_GRACE_S)
                limit = -1.0  # the signal's cut, not the store's bound
            if now < deadline:
                continue
            future.cancel()
            self._stalled = True
            article = "an" if what[0] in "aeiou" else "a"
            if limit < 0:
                raise StoreStalled(f"--checkpoint_dir {self.root}: the store had not finished {article} {what} "
                                   f"{now - started:.0f} s after it began, {STOP_GRACE_S:.0f} s after the stop signal")
            per_mib = f" plus {SECONDS_PER_MIB:g} s per MiB" if nbytes else ""
            raise StoreStalled(f"--checkpoint_dir {self.root}: the store did not finish {article} {what} within "
                               f"{limit:.0f} s (--store_timeout {self.timeout:g}{per_mib}): it stopped answering; "
                               "check that it is up and reachable (or raise --store_timeout), then relaunch with "
                               "--resume_from_checkpoint auto")

    def _failed(self, what: str, err: BaseException) -> StoreError | StoreFailed:
        """Before the lock is ours, a refusal is the settings' (exit 2); after, the store failed a run it served."""
        article = "an" if what[0] in "aeiou" else "a"
        line = (f"--checkpoint_dir {self.root}: the store refused {article} {what} ({type(err).__name__}: "
                f"{first_line(err)}); check its credentials, permissions and endpoint (AWS_ENDPOINT_URL, ...)")
        if self._lock_data is None:
            return StoreError(line)
        return StoreFailed(f"{line}, then relaunch with --resume_from_checkpoint auto")


def fs_options(scheme: str, timeout: float) -> dict[str, Any]:
    """The file system's own bounds per request, inside ours per call: s3fs hands ``config_kwargs`` to botocore's
    ``Config`` (s3fs/core.py ``_prepare_config_kwargs``; connect_timeout, read_timeout, retries). gcsfs and adlfs
    get ours per call only."""
    if scheme == "file":
        return {"auto_mkdir": True}  # the local file system makes parent folders as object stores need none
    if scheme == "s3":
        request = max(timeout / REQUEST_ATTEMPTS, 1.0)
        return {"config_kwargs": {"connect_timeout": request, "read_timeout": request,
                                  "retries": {"max_attempts": REQUEST_ATTEMPTS, "mode": "standard"}}}
    return {}
