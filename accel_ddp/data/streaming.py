"""Streaming: a ``datasets.IterableDataset`` split over the ranks, every rank taking the same optimizer steps.

For data too large even for local disk (``--streaming``; a Hub dataset, or local files read as
they stream). The training split is shuffled with a buffer (``--shuffle_buffer``, seeded by the
run's seed) and split over every reader, one per DataLoader worker of every rank, with
``datasets.distributed.split_dataset_by_node``: whole files per reader when their number divides
by the number of readers, else every reader reads all and keeps every n-th example.

What holds on this path (each tested in tests/data/test_streaming.py):

- Same steps on every rank: shares are uneven (files of different sizes, a file count that does
  not divide by the world size), so before each optimizer step every rank reads that step's
  micro-batches and one 4-byte all-reduce on a CPU group tells whether all have them. When any
  rank's share runs out, every rank ends the pass there (the other ranks' tails are dropped) and
  starts the next pass (``set_epoch``: new file order and shuffle). No DDP collective ever waits
  for a rank that has stopped (datasets#6437, datasets#6623, pytorch#141069 describe that hang).
- Each pass over the stream serves each example at most once across ranks, in a new order.
- A pass that cannot fill one optimizer step on some rank, or a read that fails on one rank (a
  damaged file), stops every rank at the same step with one line naming it.
- Resume: each rank saves its position with the checkpoint (its ``datasets`` state per reader after
  the last batch trained on, ``IterableDataset.state_dict()``, and which reader's batch comes next
  in the DataLoader's round-robin over its workers), and a resumed run continues from there: no
  example trained on before the checkpoint comes again in that pass, and batches prefetched but
  not trained on are read again. With ``--shuffle_buffer 0`` the resumed order is the uninterrupted
  one, with any number of workers, and so are the final weights (tests/lifecycle/test_guarantees.py). With a
  shuffle buffer it is not: the examples waiting in the buffers are skipped for that pass. The same
  world size, worker count, ``--shuffle_buffer`` and data (source and number of files, recorded
  with each position) are needed; otherwise the pass restarts from its beginning (warned).
- Global-batch invariance, as on the other paths, does not hold: which examples a rank reads
  depends on the world size.
- There is no epoch length: ``--max_steps`` sets the run's length; the loop sees one long epoch. A
  finished run relaunched with a higher ``--max_steps`` (and ``--resume_from_checkpoint``) continues.

Evaluation: the eval split is streamed once per rank at start-up into memory (encoded rows) and
evaluated like a memory-mapped set (``gather_for_metrics``, exact counts). Keep it modest.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any, NoReturn

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, IterableDataset

from accel_ddp.config import accumulation_steps
from accel_ddp.data.bundle import DataError
from accel_ddp.data.host_loader import default_num_workers, pin_memory_for
from accel_ddp.data.non_finite import NonFiniteInput, batch_problem, without_fix
from accel_ddp.data.sampler import sample_seed
from accel_ddp.data.workers import worker_options
from accel_ddp.lifecycle.failure import PeerFailed
from accel_ddp.util.messages import first_line, warn
from accel_ddp.util.validation import ConfigError

_HAVE, _ENDED, _FAILED = 0, 1, 2  # what each rank reports before a step; the all-reduce takes the largest


class StreamSource(IterableDataset):
    """The training stream of a bundle: a ``datasets.IterableDataset`` and how its examples become samples.

    ``decode(columns, where)`` turns a dict of columns (one micro-batch) into a list of samples;
    ``where`` describes the examples for error messages. ``files``: the local folder or file the
    stream reads, searched for a damaged file when a read fails. ``origin``: where the stream comes
    from (the Hub name, else ``files``), recorded with each saved stream position.
    """

    def __init__(self, stream, decode: Callable[[dict[str, list], list[str]], list], shuffle_buffer: int,
                 files: str | None = None, head: list[dict] | None = None, origin: str | None = None):
        self.stream, self.decode, self.shuffle_buffer, self.files = stream, decode, shuffle_buffer, files
        self.origin = origin or (os.path.realpath(files) if files else None)
        self.head = head or []  # a few of the stream's first rows, as read at start-up

    def first_samples(self, count: int) -> list:
        """Up to ``count`` samples from the stream's first rows (what a set-up check runs the model on)."""
        rows = self.head[:count]
        if not rows:
            return []
        columns = {key: [row[key] for row in rows] for key in rows[0]}
        return self.decode(columns, [f"example {i}" for i in range(len(rows))])

    def __iter__(self):
        raise TypeError("a StreamSource is read through accel_ddp.data.streaming.StreamingLoader")


class _Batches(IterableDataset):
    """Inside each DataLoader worker: its reader's share of the stream, as ``(samples, reader, position after them,
    their names)``.

    Reader ``rank * workers + slot`` of ``world_size * workers`` (``split_dataset_by_node``, done
    here rather than by ``datasets``' own worker split, whose saved positions do not load back into a
    worker in datasets 5.2: an IndexError in ``_inner_load_state_dict``). Worker ``w`` reads slot
    ``(w + first) % workers``: the DataLoader takes its workers' batches in turn from worker 0, so a
    resumed pass whose next batch is slot ``first``'s continues the turns where they stopped.
    ``states`` (slot -> position) resumes each reader where it was; a reader's last partial batch is dropped.
    """

    def __init__(self, stream, decode, per_device: int, rank: int, world_size: int, data_epoch: int,
                 states: dict[int, dict], first: int = 0):
        self.stream, self.decode, self.per_device, self.states = stream, decode, per_device, states
        self.rank, self.world_size, self.data_epoch, self.first = rank, world_size, data_epoch, first

    def __iter__(self):
        from datasets.distributed import split_dataset_by_node

        info = torch.utils.data.get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        slot = (worker + self.first) % workers
        reader = split_dataset_by_node(self.stream, self.rank * workers + slot, self.world_size * workers)
        reader.set_epoch(self.data_epoch)  # a new file order and shuffle for each pass
        if slot in self.states:
            reader.load_state_dict(self.states[slot])
        read = 0
        for columns in reader.iter(batch_size=self.per_device, drop_last_batch=True):
            where = [f"example {read + i} read by worker {slot} of rank {self.rank}" for i in range(self.per_device)]
            read += self.per_device
            named = [f"{place} in pass {self.data_epoch}" for place in where]  # for the batch's check (_collate)
            yield self.decode(columns, where), slot, reader.state_dict(), named


class StreamingLoader:
    """Micro-batches of this rank's share of a stream, moved to ``device``; the loader surface of the others.

    ``len()`` is the whole run (``max_steps * accumulation`` micro-batches): the loop sees one epoch.
    Its position goes into each checkpoint through the run's TrainState (``state_dict``/``load_state_dict``: a JSON
    file per rank; nothing unpickled).
    """

    batch_check = None  # set after the start-up probe: check(batch, where) on each host batch (accel_ddp.tasks.labels)
    on_bad_input = None  # --on_anomaly skip|rollback: report(description) of a batch with a nan/inf input, trained on

    def __init__(self, source: StreamSource, per_device_batch_size: int, global_batch_size: int, *,
                 max_steps: int | None, seed: int, rank: int = 0, world_size: int = 1,
                 device: torch.device | str = "cpu", num_workers: int | None = None,
                 collate_fn: Callable | None = None):
        if max_steps is None:
            raise ConfigError("--streaming: a stream has no length to count epochs by; set --max_steps")
        self.accumulation = accumulation_steps(per_device_batch_size, global_batch_size, world_size)
        self.steps_per_epoch = max_steps  # the loop's epoch is the whole run
        self.per_device_batch_size, self.rank, self.world_size = per_device_batch_size, rank, world_size
        self.seed = seed
        self.device = torch.device(device)
        stream = source.stream
        if source.shuffle_buffer:
            stream = stream.shuffle(seed=seed, buffer_size=source.shuffle_buffer)
        self.stream = stream
        self.decode, self.collate_fn, self.files = source.decode, collate_fn, source.files
        # What a saved position is a position in: another shuffle buffer or other files make it meaningless (and
        # datasets' load_state_dict fail: a KeyError 'shard_idx' or an IndexError in _inner_load_state_dict).
        self.made_from = {"source": source.origin, "num_shards": stream.num_shards,
                          "shuffle_buffer": source.shuffle_buffer}
        workers = default_num_workers(source) if num_workers is None else num_workers
        # More readers than files would each read every file and keep a fraction of it: no faster.
        self.num_workers = min(workers, max(stream.num_shards // world_size, 1)) if workers else 0
        self.data_epoch, self.steps_in_pass = 0, 0  # passes over the stream; optimizer steps in this one
        self.states: dict[int, dict] = {}  # reader slot -> its position after the last batch trained on
        self.next_slot = 0  # the reader whose batch comes next in the DataLoader's round-robin
        self.start = 0
        self._group = None
        # The step's status, all-reduced on the host (a CPU tensor over gloo) and read through its numpy view:
        # no device sync, no tensor made per step.
        self._flag = torch.zeros(1, dtype=torch.int32)
        self._flag_value = self._flag.numpy()
        if world_size > 1 and dist.is_initialized() and dist.get_backend() != "gloo":
            self._group = dist.new_group(backend="gloo")  # the step check must not wait for the GPU stream

    def report_bad_inputs(self, report) -> None:
        """``--on_anomaly skip|rollback``: see ``GlobalBatchLoader.report_bad_inputs``."""
        self.on_bad_input = report

    def __len__(self) -> int:
        return self.steps_per_epoch * self.accumulation - self.start

    def set_epoch(self, epoch: int) -> None:
        """The loop's epoch (always 0 here); passes over the stream are counted by ``data_epoch``."""

    def skip_first_batches(self, num_batches: int) -> StreamingLoader:
        """Resume after ``num_batches`` micro-batches: the restored stream position says where to read from."""
        self.start = num_batches
        return self

    # ---- iteration

    def __iter__(self) -> Iterator[Any]:
        micro, total = self.start, self.steps_per_epoch * self.accumulation
        while micro < total:
            batches = iter(self._pass_loader())
            while micro < total:
                step, status, problem, bug = self._read_step(batches)
                status = self._agree(status)
                if status == _FAILED:
                    self._stop(problem, bug)
                if status == _ENDED:
                    self._end_pass()
                    break
                # Counted before it is yielded: the loop saves a checkpoint after the step's last micro-batch,
                # before it asks for the next one, and that checkpoint must hold this step.
                self.steps_in_pass += 1
                for batch, slot, state in step:
                    self.states[slot] = state  # trained on once yielded: the checkpoint after this step holds it
                    self.next_slot = (slot + 1) % max(self.num_workers, 1)
                    micro += 1
                    yield self._to_device(batch)
            del batches  # ends the pass's workers
        self.start = 0

    def _pass_loader(self) -> DataLoader:
        batches = _Batches(self.stream, self.decode, self.per_device_batch_size, self.rank, self.world_size,
                           self.data_epoch, dict(self.states), first=self.next_slot)
        # Each DataLoader draws its workers' base seed from this generator, not from torch's global one, which
        # would shift dropout after a resume (the draws of the passes since the start are not replayed).
        generator = torch.Generator().manual_seed(sample_seed(self.seed, self.data_epoch, 0))
        return DataLoader(batches, batch_size=None, num_workers=self.num_workers, generator=generator,
                          collate_fn=self._collate, pin_memory=pin_memory_for(self.device),
                          **worker_options(self.num_workers))  # deaf to the job's SIGTERM, dead with this rank

    def _collate(self, item):
        """In the worker that read the samples: their batch, checked for nan and inf inputs (a bad one comes back
        flagged: every rank stops at its step with one line naming the example, or it is reported: ``_read_step``)."""
        samples, worker, state, where = item
        collate = self.collate_fn or torch.utils.data.default_collate
        batch = collate(samples)
        rows = []
        if (line := batch_problem(batch, lambda row: rows.append(row) or f"streaming: {where[row]}")) is not None:
            return NonFiniteInput(batch, rows[0], line), worker, state  # the rank decides: _read_step
        return batch, worker, state

    def _read_step(self, batches) -> tuple[list, int, str | None, Exception | None]:
        """This rank's micro-batches of the next step, its status, and what failed: bad data (one line) or a bug."""
        step = []
        try:
            for _ in range(self.accumulation):
                step.append(next(batches))
                if isinstance(step[-1][0], NonFiniteInput):  # every rank stops at this step, or (skip) reports it
                    if self.on_bad_input is None:
                        return step, _FAILED, step[-1][0].line, None
                    self.on_bad_input(without_fix(step[-1][0].line))
                    step[-1] = (step[-1][0].batch, *step[-1][1:])
                if self.batch_check is not None:  # on the host, before the copy; every rank then stops at this step
                    self.batch_check(step[-1][0], self._example_name)
        except StopIteration:
            return step, _ENDED, None, None
        except DataError as err:
            return step, _FAILED, str(err), None
        except _data_errors() as err:  # the source failed (a damaged file, a lost connection): one line
            return step, _FAILED, read_failure(err, self.files, self.rank), None
        except Exception as err:  # noqa: BLE001 - a bug (a user's collate_fn, ours): raised once every rank knows
            if _undecodable_text(err):  # the data's fault: text that is not UTF-8
                return step, _FAILED, read_failure(err, self.files, self.rank), None
            return step, _FAILED, None, err
        return step, _HAVE, None, None

    def _example_name(self, row: int) -> str:
        return (f"streaming: example {row} of a micro-batch of rank {self.rank} at optimizer step "
                f"{self.steps_in_pass + 1} of pass {self.data_epoch}")

    def _agree(self, status: int) -> int:
        """The worst status over the ranks: one CPU all-reduce per optimizer step."""
        if self.world_size == 1 or not dist.is_initialized():
            return status
        self._flag_value[0] = status
        dist.all_reduce(self._flag, op=dist.ReduceOp.MAX, group=self._group)
        return int(self._flag_value[0])

    def _stop(self, problem: str | None, bug: Exception | None) -> NoReturn:
        """Every rank stops at this step: bad data in one line (the first rank's), a bug raised with its traceback
        by the rank that met it while the others name that rank."""
        mine = (problem, None if bug is None else f"{type(bug).__name__}: {first_line(bug)}")
        every = [mine]
        if self.world_size > 1 and dist.is_initialized():
            every = [None] * self.world_size
            dist.all_gather_object(every, mine, group=self._group)
        if bug is not None:
            raise bug
        problems = [problem for problem, _ in every if problem]
        if problems:
            raise DataError(problems[0])
        rank, what = next((rank, what) for rank, (_, what) in enumerate(every) if what)
        raise PeerFailed(rank, f"streaming: rank {rank} failed while reading its training data ({what}); "
                               "its traceback says where")

    def _end_pass(self) -> None:
        if self.steps_in_pass == 0:
            raise DataError(
                f"streaming: a pass over the training stream ended before one optimizer step on some rank "
                f"(pass {self.data_epoch}; each rank needs {self.per_device_batch_size * self.accumulation} "
                "examples per step); give more data or a smaller --global_batch_size"
            )
        self.data_epoch, self.steps_in_pass, self.states, self.next_slot = self.data_epoch + 1, 0, {}, 0

    def _to_device(self, batch):
        if self.device.type == "cpu":
            return batch
        from accelerate.utils import send_to_device

        return send_to_device(batch, self.device, non_blocking=True)

    # ---- checkpoints

    def _position(self) -> dict[str, Any]:
        return {"data_epoch": self.data_epoch, "steps_in_pass": self.steps_in_pass, "world_size": self.world_size,
                "num_workers": self.num_workers, "made_from": self.made_from,
                "workers": {str(w): s for w, s in self.states.items()}, "next_worker": self.next_slot}

    def state_dict(self) -> dict[str, Any]:
        """This rank's readers' positions now (the run's TrainState takes it at each save step and writes it as this
        rank's file of the checkpoint folder, ``POSITION_FILE``)."""
        return self._position()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """From the checkpoint resumed from (``train_state.saved_positions``: rank 0's position, this rank's, the
        folder): where this rank's readers go on."""
        # The pass comes from rank 0's file on every rank (all ranks saved the same pass: they agree on every
        # step), so a rank with no file of its own (the world grew) or another world size lands in the same pass
        # as the others: in different passes they would read different shuffles and end them at different steps.
        saved, input_dir = state_dict["rank_0"], state_dict["folder"]
        if saved is None:
            if self.rank == 0:
                warn(f"{input_dir} holds no stream position: the stream starts over")
            return None
        self.data_epoch, self.steps_in_pass, self.states = saved["data_epoch"], saved["steps_in_pass"], {}
        self.next_slot = 0
        changed = self._changed_since(saved)
        if changed:
            self.steps_in_pass = 0  # the pass is read again from its beginning, on every rank
            if self.rank == 0:
                warn(f"{input_dir} was saved with {changed}: pass {self.data_epoch} of the stream starts over, so "
                      "some of its examples are trained on twice")
            return None
        mine = state_dict["mine"]
        if mine is None:
            return warn(f"{input_dir} holds no stream position for rank {self.rank}: its share of pass "
                         f"{self.data_epoch} starts over")
        self.states = {int(w): state for w, state in mine["workers"].items()}
        self.next_slot = int(mine.get("next_worker", 0))  # saved since the turns continue; older: worker 0
        return None

    def _changed_since(self, saved: dict[str, Any]) -> str | None:
        """What makes the saved positions meaningless for this run's readers, or None. Restarting the pass (as for
        another world size) keeps the run going: weights, optimizer and schedule are restored exactly."""
        made_from = saved.get("made_from") or self.made_from  # older checkpoints did not record it
        changes = [
            _changed("ranks x workers", f"{saved['world_size']} x {saved['num_workers']}",
                     f"{self.world_size} x {self.num_workers}"),
            _changed("--shuffle_buffer", made_from.get("shuffle_buffer"), self.made_from["shuffle_buffer"]),
            _changed("the data from", made_from.get("source"), self.made_from["source"]),
            _changed("files (shards)", made_from.get("num_shards"), self.made_from["num_shards"]),
        ]
        return "; ".join(change for change in changes if change) or None


def _changed(what: str, saved: Any, now: Any) -> str | None:
    return None if saved == now else f"{what} {saved}, this run has {now}"


def _data_errors() -> tuple[type[Exception], ...]:
    """What a read raises when the data or its source is at fault (not the code): reported as bad data."""
    import pyarrow
    from datasets.exceptions import DatasetsError

    return OSError, pyarrow.ArrowException, DatasetsError


def _undecodable_text(err: Exception) -> bool:
    """Text that is not UTF-8, met while reading: a UnicodeDecodeError, or, from a DataLoader worker, the
    RuntimeError torch re-raises it as (``ExceptionWrapper.reraise`` cannot rebuild a UnicodeDecodeError)."""
    return isinstance(err, UnicodeDecodeError) or (
        type(err) is RuntimeError and str(err).startswith("Caught UnicodeDecodeError in DataLoader worker"))


def read_failure(err: Exception, files: str | None, rank: int | None = None) -> str:
    """One line for a read that failed: the damaged local file when one is found, else the error's last line."""
    from accel_ddp.data.hf_source import damaged_file

    who = "" if rank is None else f" (met by rank {rank})"
    bad = damaged_file(files) if files else None
    if bad is not None:
        return bad + who
    last = (str(err).strip().splitlines() or [type(err).__name__])[-1][:300]
    return f"streaming: a read of the training data failed{who} ({last}); check the source"
