"""The machine's memory budget for ``--loader auto`` and the Hugging Face in-memory decode
(accel_ddp/data/memory_budget.py): cgroup-aware host memory per local rank, device memory on a GPU, agreed over the
ranks; above it the memory-mapped path (or a DataLoader) with one line saying why. Budgets are faked small by
patching the module's functions; runs are forked gloo ranks (tests/helpers/multiproc.py).
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
import torch
from torch.utils.data import TensorDataset

from accel_ddp.data import memory_budget
from accel_ddp.data.loaders import choose_loader
from accel_ddp.data.memory_budget import InMemoryLimit, cgroup_available_bytes
from tests.helpers.data import hf_image_dataset
from tests.helpers.multiproc import run_ranks

MiB = 2**20


def _files(root, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_cgroup_v2_takes_the_smallest_limit_of_the_ancestry_less_usage_plus_reclaimable_cache(tmp_path):
    _files(tmp_path, {"cgroup": "0::/job/step\n",
                      "fs/job/memory.max": str(1000 * MiB), "fs/job/memory.current": str(600 * MiB),
                      "fs/job/memory.stat": f"anon 1\ninactive_file {100 * MiB}\n",
                      "fs/job/step/memory.max": "max", "fs/job/step/memory.current": str(500 * MiB)})
    assert cgroup_available_bytes(str(tmp_path / "cgroup"), str(tmp_path / "fs")) == 500 * MiB


def test_cgroup_v1_no_limit_is_none_and_a_parents_limit_counts(tmp_path):
    unlimited = str(9223372036854771712)  # 0x7ffffffffffff000: v1's "no limit"
    _files(tmp_path, {"cgroup": "5:cpu:/x\n4:memory:/a/b\n", "fs/memory/a/b/memory.limit_in_bytes": unlimited,
                      "fs/memory/memory.limit_in_bytes": unlimited})
    assert cgroup_available_bytes(str(tmp_path / "cgroup"), str(tmp_path / "fs")) is None
    _files(tmp_path, {"fs/memory/a/memory.limit_in_bytes": str(300 * MiB),
                      "fs/memory/a/memory.usage_in_bytes": str(100 * MiB),
                      "fs/memory/a/memory.stat": f"total_inactive_file {20 * MiB}\n"})
    assert cgroup_available_bytes(str(tmp_path / "cgroup"), str(tmp_path / "fs")) == 220 * MiB


def test_host_memory_is_clamped_to_the_cgroup(monkeypatch):
    monkeypatch.setattr(memory_budget, "cgroup_available_bytes", lambda: 3 * MiB)
    assert memory_budget.host_available_bytes() == 3 * MiB


def test_the_budget_divides_host_memory_among_local_ranks_and_the_decode_and_keeps_device_memory_for_training(
        monkeypatch):
    monkeypatch.setattr(memory_budget, "host_available_bytes", lambda: 800 * MiB)
    assert memory_budget.budget_mb(torch.device("cpu"), ranks=4) == (100.0, math.inf)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d: (1000 * MiB, 4000 * MiB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda d: 200 * MiB)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda d: 100 * MiB)
    assert memory_budget.budget_mb(torch.device("cuda", 1), ranks=4) == (100.0, 1100 * 0.25)


def test_device_loader_takes_a_dataloader_over_the_device_budget_with_one_line(capsys):
    data = TensorDataset(torch.zeros(1024, 256), torch.zeros(1024, dtype=torch.long))  # 1 MiB + 8 KiB
    small = InMemoryLimit(4096, 0.5, 0.5, "0.25 of 2 MiB free on cuda:0")
    assert choose_loader("auto", data, 4096, small) == "dataloader"
    assert choose_loader("device", data, 4096, small) == "device"  # asked for: the user decides
    assert choose_loader("auto", data, 4096, InMemoryLimit(4096, 8, 8, "")) == "device"
    assert choose_loader("auto", data, 0, InMemoryLimit(4096, 8, 8, "")) == "dataloader"  # the flag's own limit
    lines = [line for line in capsys.readouterr().err.splitlines() if "budget" in line]
    assert lines == ["accel_ddp: note: the training set would take 1.01 MiB per rank, over this machine's budget of "
                     "0.5 MiB (0.25 of 2 MiB free on cuda:0), which --device_loader_max_mb 4096 does not raise: "
                     "reading it through a DataLoader"]


def _hf_runs(folder, outs: dict[str, Path], small_on_rank: int = 1) -> dict[str, list[dict]]:
    """The runs of ``outs`` in turn in the same forked ranks, summaries by rank; in the run named "small", rank
    ``small_on_rank`` sees 10 KiB of host memory (the set decodes to 18 KiB), in the others what the machine has."""
    def fn():
        from accel_ddp.cli.args import parse_args
        from accel_ddp.loop import train

        machines = memory_budget.host_available_bytes
        summaries = []
        for name, out in outs.items():
            small = name == "small" and int(os.environ["RANK"]) == small_on_rank
            memory_budget.host_available_bytes = (lambda: 40 * 1024) if small else machines
            summaries.append(train(parse_args(["--dataset", "hf", "--data_dir", str(folder), "--model", "mnist_cnn",
                                               "--max_steps", "3", "--global_batch_size", "16", "--output_dir",
                                               str(out)])))
        return summaries

    return dict(zip(outs, zip(*run_ranks(fn, world_size=2), strict=True), strict=True))


def test_a_decode_over_the_machines_budget_stays_memory_mapped_on_every_rank_with_one_line(tmp_path, capfd):
    """Only rank 1 sees a small budget: the ranks agree on the smallest, so both read memory-mapped (without the
    agreement rank 0 would decode into memory and take the device loader); the line comes once. Then, in the same
    ranks, the machine's budget: decoded into memory, no line."""
    folder = tmp_path / "d"
    folder.mkdir()
    hf_image_dataset(96, 0, size=8, mode="RGB").to_parquet(str(folder / "train.parquet"))
    hf_image_dataset(20, 1, size=8, mode="RGB").to_parquet(str(folder / "test.parquet"))
    capfd.readouterr()
    runs = _hf_runs(folder, {"small": tmp_path / "small", "roomy": tmp_path / "roomy"})
    err = capfd.readouterr().err
    assert [(s["loader"], s["data_source"]) for s in runs["small"]] == [("dataloader", "memory_mapped")] * 2
    notes = [line for line in err.splitlines() if "budget" in line]  # of both runs: the roomy one says none
    assert len(notes) == 1 and notes[0].startswith(
        "accel_ddp: note: the decoded training set would take 0.0183 MiB per rank, over this machine's budget of "
        "0.00977 MiB (host memory available, cgroup-aware, / 2 local ranks / 2 for the decode's working copy, the "
        "smallest over the ranks)")
    assert notes[0].endswith("does not raise: reading it memory-mapped") and "Traceback" not in err
    assert [(s["loader"], s["data_source"]) for s in runs["roomy"]] == [("device", "in_memory")] * 2


@pytest.mark.parametrize("loader", ["device"])
def test_loader_device_decodes_whatever_the_budget(tmp_path, loader, monkeypatch):
    monkeypatch.setattr(memory_budget, "host_available_bytes", lambda: 1024)
    folder = tmp_path / "d"
    folder.mkdir()
    hf_image_dataset(32, 0, size=8).to_parquet(str(folder / "train.parquet"))

    def fn():
        from accel_ddp.cli.args import parse_args
        from accel_ddp.loop import train

        return train(parse_args(["--dataset", "hf", "--data_dir", str(folder), "--model", "mnist_cnn", "--loader",
                                 loader, "--max_steps", "1", "--global_batch_size", "8",
                                 "--output_dir", str(tmp_path / "o")]))

    assert run_ranks(fn, world_size=1)[0]["data_source"] == "in_memory"


def test_packed_token_blocks_over_the_budget_stay_memory_mapped_with_one_line_and_fit_in_memory_below_it(
        tmp_path, capsys, monkeypatch):
    """causal_lm --packing: blocks within the budget are read once into TokenBlocks (the device loader's), the
    same ids as the datasets cache holds; over it they stay a memory-mapped datasets.Dataset, with one line."""
    pytest.importorskip("transformers")
    import datasets

    from accel_ddp.data.hf import HFSource
    from accel_ddp.data.in_memory import TokenBlocks
    from accel_ddp.data.text import TextOptions, build_text
    from tests.helpers.text import build_word_tokenizer, sentences

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "cache"))
    texts = tmp_path / "texts"
    texts.mkdir()
    for split, seed in (("train", 0), ("test", 1)):
        (texts / f"{split}.json").write_text("".join(f'{{"text": "{t}"}}\n' for t, _ in sentences(60, seed)))
    options = TextOptions(str(build_word_tokenizer([t for t, _ in sentences(60, 0)], tmp_path / "tok")),
                          max_length=16, packing=True, labels=False)
    roomy, _ = build_text(str(texts), HFSource(in_memory_max_mb=1.0, memory_limit=InMemoryLimit(4096, 1, 1, "")),
                          options)
    small = InMemoryLimit(4096, 0.001, 0.001, "host memory available / 2 local ranks")
    mapped, _ = build_text(str(texts), HFSource(in_memory_max_mb=small.decode_mb, memory_limit=small), options)
    assert isinstance(roomy.train, TokenBlocks) and isinstance(roomy.eval, TokenBlocks)
    assert isinstance(mapped.train, datasets.Dataset) and not isinstance(mapped.train, TokenBlocks)
    assert roomy.train.inputs.shape == (len(mapped.train), 16) and roomy.train.inputs.dtype == torch.int64
    assert torch.equal(roomy.train.inputs, torch.stack([row["input_ids"] for row in mapped.train]))
    assert torch.equal(roomy.eval[3]["input_ids"], mapped.eval[3]["input_ids"])
    nbytes = (len(mapped.train) + len(mapped.eval)) * 16 * 8
    lines = [line for line in capsys.readouterr().err.splitlines() if "budget" in line]
    assert lines == [f"accel_ddp: note: the packed token blocks would take {nbytes / MiB:.3g} MiB per rank, over this "
                     "machine's budget of 0.001 MiB (host memory available / 2 local ranks), which "
                     "--device_loader_max_mb 4096 does not raise: reading it memory-mapped"]
