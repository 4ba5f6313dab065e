"""Issue 51 item 2: every file and folder a run writes follows the process's umask (0644/0755 under umask 022), the
weights included: safetensors writes 0600 files and ``tempfile.mkdtemp`` 0700 folders whatever the umask, which
teammates on a shared file system cannot read (accel_ddp/util/atomic.py ``follow_umask``)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from accel_ddp.util.atomic import current_umask, follow_umask
from tests.helpers.runs import train_ranks
from tests.helpers.text import tiny_gpt

pytest.importorskip("peft")

DATA = ["--task", "causal_lm", "--dataset", "tests.helpers.text:build_sequences", "--num_workers", "0"]
LORA = ["--peft", "lora", "--lora_r", "4", "--lora_target_modules", "c_attn", "--merge_adapter"]
STEPS = ["--global_batch_size", "8", "--max_steps", "4", "--checkpointing_steps", "2", "--log_every", "2",
         "--report_to", "csv"]


def modes(root: Path) -> dict[str, int]:
    """Every file and folder under ``root`` (itself included): relative path -> permission bits."""
    found = {".": stat.S_IMODE(root.stat().st_mode)}
    for parent, folders, files in os.walk(root):
        for name in folders + files:
            path = Path(parent) / name
            found[str(path.relative_to(root))] = stat.S_IMODE(path.stat().st_mode)
    return found


def expected(root: Path, mask: int) -> dict[str, int]:
    return {name: (0o777 if (root / name).is_dir() else 0o666) & ~mask for name in modes(root)}


@pytest.fixture(params=[0o022, 0o027], ids=["umask022", "umask027"])
def umask(request):
    before = os.umask(request.param)  # the forked rank inherits it
    try:
        yield request.param
    finally:
        os.umask(before)


def test_every_file_and_folder_of_a_finished_run_follows_the_umask(tmp_path, umask, tiny_args):
    """A LoRA run with csv tracking, the adapter and merged exports, its checkpoints through fsspec (``file://``);
    and a run with its checkpoints in the output folder: the weights (0600 before) like every other file."""
    base = tmp_path / "base"
    tiny_gpt().save_pretrained(str(base))
    out, store = tmp_path / "run", tmp_path / "store"
    train_ranks([*DATA, "--model", str(base), *LORA, *STEPS, "--output_dir", str(out),
                 "--checkpoint_dir", f"file://{store}"], world_size=1)
    written = modes(out)
    assert {"model.safetensors", "adapter/adapter_model.safetensors", "hf_model/model.safetensors", "metrics.csv",
            "run.log"} <= set(written), sorted(written)
    assert written == expected(out, umask)
    assert "step_00000004/model.safetensors" in modes(store) and modes(store) == expected(store, umask)

    local = tmp_path / "local"
    train_ranks([*tiny_args, "--checkpointing_steps", "8", "--output_dir", str(local)], world_size=1)
    assert "checkpoints/step_00000016/model.safetensors" in modes(local) and modes(local) == expected(local, umask)


def test_follow_umask_gives_a_folder_tree_the_modes_of_this_process(tmp_path, umask):
    assert current_umask() == umask
    (tmp_path / "a" / "b").mkdir(parents=True, mode=0o700)
    (tmp_path / "a" / "b" / "w.safetensors").write_bytes(b"x")
    os.chmod(tmp_path / "a" / "b" / "w.safetensors", 0o600)
    (tmp_path / "a" / "run.sh").write_text("#!/bin/sh\n")
    os.chmod(tmp_path / "a" / "run.sh", 0o700)
    follow_umask(str(tmp_path / "a"))
    assert modes(tmp_path / "a") == {".": 0o777 & ~umask, "b": 0o777 & ~umask, "b/w.safetensors": 0o666 & ~umask,
                                     "run.sh": 0o777 & ~umask}


def test_a_text_cache_entry_follows_the_umask(tmp_path, umask):
    """``tempfile.mkdtemp`` (the entry's temporary folder, renamed into place) makes 0700 folders."""
    import torch

    from accel_ddp.data.text_cache import write_blocks

    write_blocks(str(tmp_path / "cache"), "k" * 16, (torch.zeros(2, 4, dtype=torch.int64),) * 2, {})
    assert modes(tmp_path / "cache") == expected(tmp_path / "cache", umask)
