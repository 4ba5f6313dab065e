"""Datasets built from files made here, the device loader against the DataLoader path, and offline errors.

Nothing is downloaded: every source (IDX files, CIFAR pickle batches, class folders of PNGs,
parquet, CSV, ``save_to_disk``) is written into a temporary folder first.
"""

from __future__ import annotations

import gc
import sys

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import Subset, TensorDataset

from accel_ddp import train
from accel_ddp.data import (
    CIFAR10_MEAN,
    CIFAR10_STD,
    MNIST_MEAN,
    MNIST_STD,
    DeviceLoader,
    HostLoader,
    InMemoryDataset,
    build_datasets,
    build_eval_loader,
    choose_loader,
    default_num_workers,
)
from accel_ddp.data.device_loader import DeviceEvalLoader
from accel_ddp.data.host_loader import pin_memory_for
from accel_ddp.data.in_memory import CROP_PADDING, crop_flip
from accel_ddp.data.sampler import epoch_order
from accel_ddp.util.validation import ConfigError
from tests.helpers import data as helpers_data
from tests.helpers.data import write_cifar, write_png_classes, write_shards
from tests.helpers.multiproc import run_ranks
from tests.helpers.runs import load_weights, read_summary, train_ranks

# ----------------------------------------------------------------------------- file writers


def index_dataset(n: int = 103, shape=(1, 3, 3)) -> InMemoryDataset:
    """uint8 inputs, normalised like MNIST; the label of sample i is i, so a batch says which samples it holds."""
    inputs = torch.randint(0, 256, (n, *shape), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    return InMemoryDataset(inputs, torch.arange(n), mean=(MNIST_MEAN,), std=(MNIST_STD,), scale=255.0)


@pytest.fixture
def accelerate_state():
    """prepare_data_loader reads Accelerate's process state; leave none behind for other tests."""
    from accelerate.state import AcceleratorState, GradientState

    yield
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def accelerate_loader(dataset, per_device: int, global_batch: int, world: int, rank: int, seed: int):
    """Rank `rank`'s loader as Accelerate shards a textbook one: its seedable sampler, then BatchSamplerShard.

    This was the DataLoader path before the package had its own sampler; the order must not change.
    """
    from accelerate.data_loader import prepare_data_loader
    from torch.utils.data import DataLoader, RandomSampler

    used = len(dataset) // global_batch * global_batch
    textbook = DataLoader(dataset, batch_size=per_device, sampler=RandomSampler(dataset, num_samples=used),
                          drop_last=True)
    return prepare_data_loader(textbook, num_processes=world, process_index=rank, use_seedable_sampler=True,
                               data_seed=seed)


def classic_batches(dataset, per_device: int, global_batch: int, world: int, rank: int, seed: int, epoch: int):
    """What rank `rank` of `world` got from Accelerate's sharding in epoch `epoch`."""
    loader = accelerate_loader(dataset, per_device, global_batch, world, rank, seed)
    loader.set_epoch(epoch)
    return list(loader)


LAYOUTS = [  # (world size, per-device batch, global batch): accumulation = global / (world * per-device)
    (1, 32, 32), (2, 16, 32), (2, 8, 32), (4, 4, 32), (3, 4, 24),
]


# ----------------------------------------------------------------------------- fast path == DataLoader path


@pytest.mark.parametrize("world,per_device,global_batch", LAYOUTS)
def test_device_and_dataloader_paths_serve_accelerates_order_bit_for_bit(world, per_device, global_batch,
                                                                         accelerate_state):
    dataset = index_dataset()
    for rank in range(world):
        fast = DeviceLoader(dataset, per_device, global_batch, seed=11, rank=rank, world_size=world)
        host = HostLoader(dataset, per_device, global_batch, seed=11, rank=rank, world_size=world, num_workers=0)
        for epoch in (0, 1):
            fast.set_epoch(epoch)
            host.set_epoch(epoch)
            fast_batches, host_batches = list(fast), list(host)
            classic = classic_batches(dataset, per_device, global_batch, world, rank, seed=11, epoch=epoch)
            assert len(fast_batches) == len(host_batches) == len(classic) == len(fast) == len(host)
            for (fx, fy), (hx, hy), (cx, cy) in zip(fast_batches, host_batches, classic, strict=True):
                assert torch.equal(fy, cy) and torch.equal(hy, cy)  # the same samples in the same micro-step
                assert torch.equal(fx, cx) and torch.equal(hx, cx)  # normalised to the same bits
                assert fx.dtype == torch.float32


def test_each_epoch_serves_every_sample_once_in_a_new_order_the_same_for_any_world_size():
    dataset = index_dataset(n=100)  # 100 // 24 = 4 optimizer steps, the last 4 samples dropped
    global_batch = 24

    def per_step_samples(world: int, per_device: int, epoch: int) -> list[list[int]]:
        loaders = [DeviceLoader(dataset, per_device, global_batch, seed=5, rank=r, world_size=world)
                   for r in range(world)]
        for loader in loaders:
            loader.set_epoch(epoch)
        ranks = [[y.tolist() for _, y in loader] for loader in loaders]
        accumulation = len(ranks[0]) // loaders[0].steps_per_epoch
        steps = []
        for step in range(loaders[0].steps_per_epoch):
            micro = range(step * accumulation, (step + 1) * accumulation)
            steps.append(sorted(i for r in ranks for m in micro for i in r[m]))
        return steps

    reference = per_step_samples(1, 24, epoch=0)
    flat = [i for step in reference for i in step]
    assert len(flat) == len(set(flat)) == 96  # each sample at most once, all whole global batches
    order = epoch_order(100, 96, seed=5, epoch=0).tolist()
    assert [sorted(order[s * 24:(s + 1) * 24]) for s in range(4)] == reference
    for world, per_device in [(2, 12), (2, 4), (3, 8), (4, 2), (6, 4)]:
        assert per_step_samples(world, per_device, epoch=0) == reference, (world, per_device)
    assert per_step_samples(1, 24, epoch=1) != reference  # a new order each epoch
    assert per_step_samples(2, 6, epoch=1) == per_step_samples(1, 24, epoch=1)


def test_epochs_advance_after_a_full_pass_and_set_epoch_replays_one():
    loader = DeviceLoader(index_dataset(), 8, 16, seed=0)
    first = [y.tolist() for _, y in loader]
    second = [y.tolist() for _, y in loader]  # the loader moved on to epoch 1 by itself, as a DataLoaderShard does
    assert first != second
    loader.set_epoch(0)
    assert [y.tolist() for _, y in loader] == first


def test_skip_first_batches_resumes_mid_epoch_like_accelerate(accelerate_state):
    from accelerate.data_loader import skip_first_batches

    dataset = index_dataset()
    for loader in (DeviceLoader(dataset, 8, 32, seed=4, rank=1, world_size=2),
                   HostLoader(dataset, 8, 32, seed=4, rank=1, world_size=2, num_workers=0)):
        loader.set_epoch(1)
        full = [y.tolist() for _, y in loader]
        loader.set_epoch(1)
        resumed = loader.skip_first_batches(4)  # after optimizer step 2 of this epoch (accumulation 2)
        assert len(resumed) == len(full) - 4
        assert [y.tolist() for _, y in resumed] == full[4:]
        assert [y.tolist() for _, y in loader] != full  # then the next epoch, whole
        assert len(loader) == len(full)
        with pytest.raises(ValueError):
            loader.skip_first_batches(len(full) + 1)

    classic = accelerate_loader(dataset, 8, 32, world=2, rank=1, seed=4)
    classic.set_epoch(1)
    assert [y.tolist() for _, y in skip_first_batches(classic, 4)] == full[4:]


def test_crop_flip_augmentation_is_per_sample_correct_and_the_same_for_any_world_size():
    images = torch.randint(0, 256, (40, 3, 6, 5), dtype=torch.uint8, generator=torch.Generator().manual_seed(8))
    params = torch.tensor([[0, 0, 0], [8, 8, 1], [4, 4, 0], [3, 5, 1]])
    out = crop_flip(images[:4], params)
    padded = torch.nn.functional.pad(images[:4], (CROP_PADDING,) * 4)
    for i, (dy, dx, flip) in enumerate(params.tolist()):
        expected = padded[i, :, dy:dy + 6, dx:dx + 5]
        assert torch.equal(out[i], expected.flip(-1) if flip else expected)
    assert torch.equal(out[2], images[2])  # centred, not flipped: the image itself

    data = InMemoryDataset(images, torch.arange(40), mean=CIFAR10_MEAN, std=CIFAR10_STD, scale=255.0,
                           augment="crop_flip")
    one = DeviceLoader(data, 8, 8, seed=1)
    two = [DeviceLoader(data, 4, 8, seed=1, rank=r, world_size=2) for r in range(2)]
    one_rank = [x for x, _ in one]
    two_ranks = list(zip(*[[x for x, _ in loader] for loader in two], strict=True))
    for step, (x, (x0, x1)) in enumerate(zip(one_rank, two_ranks, strict=True)):
        assert torch.equal(x, torch.cat([x0, x1])), step  # same crops and flips, whatever the world size
    plain = DeviceLoader(InMemoryDataset(images, torch.arange(40), mean=CIFAR10_MEAN, std=CIFAR10_STD,
                                         scale=255.0), 8, 8, seed=1)
    assert not all(torch.equal(a, b) for (a, _), (b, _) in zip(one, plain, strict=True))
    sample, _ = data[0]  # the DataLoader path augments per read with the global generator
    assert sample.shape == (3, 6, 5) and sample.dtype == torch.float32


@pytest.mark.parametrize("workers", [0, 2])
def test_augmentation_depends_on_seed_epoch_and_position_only(workers):
    """Random reads give each sample the same draw in any worker, at any world size and after a mid-epoch resume."""
    dataset = helpers_data.AugmentedIndexDataset(50)  # noise from torch's global generator on every read

    def noise_by_sample(loaders, epoch=1) -> dict[int, float]:
        seen = {}
        for loader in loaders:
            loader.set_epoch(epoch)
            for x, _ in loader:
                seen.update({int(i): noise for i, noise in x.tolist()})
        return seen

    one = noise_by_sample([HostLoader(dataset, 16, 16, seed=3, num_workers=0)])
    two = noise_by_sample([HostLoader(dataset, 4, 16, seed=3, rank=r, world_size=2, num_workers=workers)
                           for r in range(2)])  # accumulation 2
    assert one == two and len(one) == 48 and len(set(one.values())) == 48
    assert noise_by_sample([HostLoader(dataset, 16, 16, seed=3, num_workers=0)], epoch=2) != one
    resumed = HostLoader(dataset, 4, 16, seed=3, rank=1, world_size=2, num_workers=workers)
    resumed.set_epoch(1)
    tail = {int(i): noise for x, _ in resumed.skip_first_batches(4) for i, noise in x.tolist()}
    assert len(tail) == 8 and all(one[i] == noise for i, noise in tail.items())  # after optimizer step 2 of 3

    images = torch.randint(0, 256, (40, 3, 6, 5), dtype=torch.uint8, generator=torch.Generator().manual_seed(8))
    cifar_like = InMemoryDataset(images, torch.arange(40), mean=CIFAR10_MEAN, std=CIFAR10_STD, scale=255.0,
                                 augment="crop_flip")  # batch-wise crops: the DataLoader path draws as on the device
    device = [x for x, _ in DeviceLoader(cifar_like, 4, 16, seed=1, rank=1, world_size=2)]
    host = [x for x, _ in HostLoader(cifar_like, 4, 16, seed=1, rank=1, world_size=2, num_workers=workers)]
    assert len(device) == len(host) == 4 and all(torch.equal(a, b) for a, b in zip(device, host, strict=True))


@pytest.mark.parametrize("workers", [0, 1])
def test_no_training_loader_moves_the_global_generator(workers):
    """Dropout masks then match between paths, and a resumed epoch needs no RNG correction."""
    dataset = InMemoryDataset(torch.randint(0, 256, (40, 3, 6, 5), dtype=torch.uint8), torch.arange(40),
                              scale=255.0, augment="crop_flip")  # augmentation draws too: from its own seeds
    for loader in (DeviceLoader(dataset, 8, 32, seed=0), HostLoader(dataset, 8, 32, seed=0, num_workers=workers),
                   HostLoader(helpers_data.IndexDataset(40), 8, 32, seed=0, num_workers=workers)):
        torch.manual_seed(0)
        expected = torch.rand(1)
        torch.manual_seed(0)
        list(loader)
        list(loader.skip_first_batches(2))
        assert torch.equal(torch.rand(1), expected), type(loader).__name__
    del loader
    gc.collect()  # persistent workers and their queue's feeder thread end now, before the next test forks ranks


def test_loader_choice_threshold_and_worker_defaults(tmp_path):
    mnist_like = index_dataset(n=64)
    assert choose_loader("auto", mnist_like, device_loader_max_mb=1) == "device"
    assert choose_loader("auto", Subset(mnist_like, range(10)), device_loader_max_mb=1) == "device"
    assert choose_loader("auto", mnist_like, device_loader_max_mb=0) == "dataloader"  # over the threshold
    assert choose_loader("dataloader", mnist_like, device_loader_max_mb=1) == "dataloader"
    assert choose_loader("device", mnist_like, device_loader_max_mb=0) == "device"  # asked for explicitly
    write_png_classes(tmp_path / "imgs", ["a", "b"], per_class=5)
    folder = build_datasets("imagefolder", str(tmp_path / "imgs"), download=False).train
    assert choose_loader("auto", folder, device_loader_max_mb=4096) == "dataloader"
    with pytest.raises(ConfigError, match="--loader dataloader"):
        choose_loader("device", folder, device_loader_max_mb=4096)
    assert default_num_workers(mnist_like) == 0  # tensors in memory: workers would only copy
    assert default_num_workers(folder) >= 1  # per-sample decoding: worker processes
    loader = HostLoader(folder, 4, 8, seed=0).loader
    assert loader.num_workers >= 1 and loader.persistent_workers
    assert build_eval_loader(mnist_like, 16).num_workers == 0


@pytest.mark.parametrize("device", ["cpu", "cuda", "cuda:1", "meta"])
def test_every_dataloader_pins_its_batches_by_the_one_rule(tmp_path, device):
    """Page-locked batches where they go to a CUDA device, and only there (a CPU run on a machine with a GPU too):
    the training DataLoader, the eval one and each streamed pass's alike. Built, not iterated: no GPU needed."""
    import datasets

    from accel_ddp.data.streaming import StreamingLoader, StreamSource

    pinned = device.startswith("cuda")
    assert pin_memory_for(device) is pin_memory_for(torch.device(device)) is pinned
    data = TensorDataset(torch.randn(16, 3), torch.arange(16))
    assert HostLoader(data, 4, 8, seed=0, num_workers=0, device=device).loader.pin_memory is pinned
    assert build_eval_loader(data, 4, 0, device=device).pin_memory is pinned
    stream = datasets.load_dataset("parquet", data_files=write_shards(tmp_path, [8]), split="train", streaming=True)
    streamed = StreamingLoader(StreamSource(stream, lambda columns, where: [], 0), 2, 2, max_steps=2, seed=0,
                               num_workers=0, device=device)
    assert streamed._pass_loader().pin_memory is pinned


def test_fast_loader_accepts_tensor_datasets_and_subsets_as_stored():
    x, y = torch.randn(50, 3), torch.arange(50)
    for dataset, expected in [(TensorDataset(x, y), x), (Subset(TensorDataset(x, y), range(10, 50)), x[10:])]:
        loader = DeviceLoader(dataset, 5, 10, seed=2)
        for inputs, labels in loader:
            assert torch.equal(inputs, expected[labels - (10 if len(dataset) == 40 else 0)])
    with pytest.raises(ConfigError, match="fewer than one global batch"):
        DeviceLoader(TensorDataset(x, y), 32, 64, seed=0)


@pytest.mark.parametrize("num, batch, world", [(37, 4, 1), (37, 4, 2), (37, 4, 3), (37, 4, 5), (11, 5, 2), (8, 2, 4)])
def test_eval_shards_cover_every_sample_once_in_equal_batch_counts(num, batch, world):
    images, labels = torch.randint(0, 256, (num, 1, 4, 4), dtype=torch.uint8), torch.arange(num)
    data = InMemoryDataset(images, labels, scale=255.0, mean=(0.5,), std=(0.25,))
    seen, counts = [], set()
    for rank in range(world):
        shard = DeviceEvalLoader(data, batch, rank=rank, world_size=world)
        batches = list(shard)
        counts.add(len(batches))
        assert len(batches) == len(shard) and all(1 <= len(y) <= batch for _, y in batches)
        for inputs, y in batches:
            assert torch.allclose(inputs, (images[y].float() / 255.0 - 0.5) / 0.25)
            seen += y.tolist()
    assert sorted(seen) == list(range(num))  # each sample on exactly one rank, none repeated to pad
    assert len(counts) == 1  # the same number of forwards on every rank (DDP and FSDP communicate in them)


def test_eval_sets_too_small_to_shard_go_through_a_dataloader():
    data = TensorDataset(torch.randn(3, 2), torch.arange(3))
    assert not DeviceEvalLoader.can_shard(3, 4, world_size=2) and not DeviceEvalLoader.can_shard(40, 1, 2)
    with pytest.raises(ConfigError, match="evaluate through a DataLoader"):
        DeviceEvalLoader(data, 4, rank=0, world_size=2)


# ----------------------------------------------------------------------------- real processes

def loop_with_both_loaders(global_batch: int, per_device: int) -> dict:
    """A hand-written Accelerate loop over both loaders (what a user of build_loaders writes); what each served."""
    from accelerate import Accelerator, DataLoaderConfiguration, PartialState
    from accelerate.utils import set_seed

    from accel_ddp.data import build_loaders
    from accel_ddp.data.builtin import read_digits
    from accel_ddp.evaluation import evaluate

    world = PartialState(cpu=True).num_processes
    accumulation = global_batch // (world * per_device)
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=accumulation,
                              dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=7))
    images, targets = read_digits()  # load_digits()'s arrays without importing scikit-learn (~1.2 s in each rank)
    x = torch.tensor(images.reshape(len(images), 64), dtype=torch.float32) / 16.0
    x = torch.cat([x, torch.arange(len(x), dtype=torch.float32)[:, None]], 1)  # column 64: the sample's index
    y = torch.tensor(targets)
    train_ds, eval_ds = TensorDataset(x[:400], y[:400]), TensorDataset(x[1400:], y[1400:])  # 397: odd

    class Net(torch.nn.Module):  # ignores the index column
        def __init__(self):
            super().__init__()
            self.body = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Dropout(0.3),
                                            torch.nn.Linear(32, 10))

        def forward(self, x):
            return self.body(x[:, :64])

    results = {}
    for kind in ("dataloader", "device"):
        set_seed(0)
        model = Net()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        loaders = build_loaders(accelerator, train_ds, eval_ds, per_device_batch_size=per_device,
                                global_batch_size=global_batch, loader=kind)
        model, optimizer = accelerator.prepare(model, optimizer)
        seen, syncs, evals = [], [], []
        for epoch in range(2):
            loaders.train.set_epoch(epoch)
            for micro_step, (inputs, labels) in enumerate(loaders.train):
                with accelerator.accumulate(model):
                    loss = F.cross_entropy(model(inputs), labels)
                    accelerator.backward(loss)
                    optimizer.step()
                    optimizer.zero_grad()
                seen.append(inputs[:, 64].long().tolist())
                syncs.append(accelerator.sync_gradients)
                if epoch == 0 and micro_step == 2 * accumulation - 1:  # evaluate mid-epoch, after step 2
                    evals.append(evaluate(accelerator, model, loaders.eval)["eval_samples"])
            evals.append(evaluate(accelerator, model, loaders.eval)["eval_samples"])
        loaders.train.set_epoch(1)
        resumed = [i[:, 64].long().tolist() for i, _ in loaders.train.skip_first_batches(accumulation)]
        weights = torch.cat([p.detach().flatten() for p in accelerator.unwrap_model(model).parameters()])
        results[kind] = {"kind": loaders.kind, "seen": seen, "syncs": syncs, "evals": evals, "resumed": resumed,
                         "weights": weights.tolist(), "micro_steps": len(loaders.train),
                         "accumulation": accumulation}
    accelerator.end_training()
    return results


def run_loop(world: int, global_batch: int, per_device: int) -> list[dict]:
    return run_ranks(lambda: loop_with_both_loaders(global_batch, per_device), world_size=world)


def test_both_loaders_train_identically_under_two_processes():
    """Same samples per micro-step, sync only on optimizer steps, exact eval counts, bit-identical weights."""
    two = run_loop(world=2, global_batch=32, per_device=8)  # accumulation 2
    one = run_loop(world=1, global_batch=32, per_device=16)  # accumulation 2
    for ranks in (one, two):
        for rank in ranks:
            fast, classic = rank["device"], rank["dataloader"]
            assert (fast["kind"], classic["kind"]) == ("device", "dataloader")
            assert fast["seen"] == classic["seen"]
            a = fast["accumulation"]
            assert fast["resumed"] == classic["resumed"] == fast["seen"][fast["micro_steps"] + a:]
            for run in (fast, classic):
                assert run["syncs"] == [(i + 1) % a == 0 for i in range(len(run["syncs"]))]
                assert run["evals"] == [397, 397, 397]
            assert fast["weights"] == classic["weights"]  # dropout included: the RNG streams match too
    for kind in ("device", "dataloader"):  # each optimizer step holds the same samples for 1 and 2 processes
        a = 2  # both layouts accumulate 2 micro-steps
        per_step_two = [sorted(two[0][kind]["seen"][i] + two[0][kind]["seen"][i + 1] + two[1][kind]["seen"][i]
                               + two[1][kind]["seen"][i + 1]) for i in range(0, len(two[0][kind]["seen"]), a)]
        per_step_one = [sorted(one[0][kind]["seen"][i] + one[0][kind]["seen"][i + 1])
                        for i in range(0, len(one[0][kind]["seen"]), a)]
        assert per_step_two == per_step_one
        epoch0 = [i for step in per_step_one[:len(per_step_one) // 2] for i in step]
        assert len(epoch0) == len(set(epoch0)) == 384  # 400 // 32 steps of 32 samples, each once (16 left out)


def test_own_model_and_dataset_through_import_strings_under_two_processes(tmp_path):
    out = tmp_path / "run"
    train_ranks(["--dataset", "examples.custom_model_and_data:build_dataset",
                 "--model", "examples.custom_model_and_data:build_model",
                 "--epochs", "1", "--global_batch_size", "64", "--output_dir", str(out)])  # 48 steps: accuracy 0.99
    summary = read_summary(out)
    assert summary["world_size"] == 2 and summary["eval_samples"] == 600
    assert summary["eval_accuracy"] > 0.9
    assert any(k.startswith("blocks.") for k in load_weights(out))  # the example's own ResidualMLP


def test_own_model_and_dataset_through_the_python_api_under_two_processes(tmp_path, capfd, monkeypatch):
    from examples import custom_model_and_data as example

    out = tmp_path / "api"
    monkeypatch.setattr(sys, "argv", ["custom_model_and_data.py", "--output_dir", str(out), "--epochs", "1"])
    run_ranks(example.main)
    summary = read_summary(out)
    assert summary["world_size"] == 2 and summary["eval_samples"] == 600 and summary["eval_accuracy"] > 0.9
    assert capfd.readouterr().out.count("eval accuracy") == 1  # printed by the main process only


# 22 optimizer steps per epoch of digits: 30 steps reach into epoch 1 (a new order); one checkpoint, of step 25 (in
# epoch 1), the one the device loader's resume starts from.
DIGITS_RUN = ["--dataset", "digits", "--model", "mnist_cnn", "--max_steps", "30", "--global_batch_size", "64",
              "--per_device_batch_size", "16", "--checkpointing_steps", "25"]


@pytest.fixture(scope="module")
def digits_whole_runs(tmp_path_factory) -> dict:
    """DIGITS_RUN uninterrupted on each training loader, trained once for the module; tests only read them."""
    root = tmp_path_factory.mktemp("digits")
    for kind in ("device", "dataloader"):
        train_ranks([*DIGITS_RUN, "--loader", kind, "--output_dir", str(root / kind)])
    return {kind: root / kind for kind in ("device", "dataloader")}


def test_device_and_dataloader_paths_end_with_the_same_weights(digits_whole_runs):
    device, classic = (load_weights(digits_whole_runs[kind]) for kind in ("device", "dataloader"))
    assert all(torch.equal(device[k], classic[k]) for k in classic)  # mnist_cnn has dropout: RNG streams match
    for kind in ("device", "dataloader"):
        summary = read_summary(digits_whole_runs[kind])
        assert summary["eval_samples"] == 360 and summary["grad_accum_steps"] == 2
        assert summary.get("loader", kind) == kind


def test_cifar10_files_on_the_device_loader_with_resnet18(tmp_path):
    write_cifar(tmp_path / "data", per_batch=16)
    out = tmp_path / "run"
    train_ranks(["--dataset", "cifar10", "--data_dir", str(tmp_path / "data"), "--model", "resnet18",
                 "--width", "4", "--epochs", "2", "--global_batch_size", "16", "--loader", "device",
                 "--output_dir", str(out)])
    summary = read_summary(out)
    assert summary["optimizer_steps"] == 10 and summary["eval_samples"] == 16
    assert load_weights(out)["conv1.weight"].shape == (4, 3, 3, 3)


def test_device_loader_resumes_mid_epoch_to_the_same_weights(tmp_path, digits_whole_runs):
    """The whole run's checkpoint of step 25 (22 steps per epoch: in epoch 1), resumed into a folder of its own: the
    resumed run skips what the checkpoint holds and ends where the whole run ends. (The checkpoint is the one a run
    failing after it would have left; failures and ``auto``: tests/checkpoint/.)"""
    whole = digits_whole_runs["device"]
    resumed = tmp_path / "resumed"
    train_ranks([*DIGITS_RUN, "--loader", "device", "--output_dir", str(resumed),
                 "--resume_from_checkpoint", str(whole / "checkpoints" / "step_00000025")])
    summary = read_summary(resumed)
    assert summary["resumed_from_step"] == 25 and summary["optimizer_steps"] == 30
    whole, resumed = load_weights(whole), load_weights(resumed)
    assert all(torch.equal(whole[k], resumed[k]) for k in whole)


def test_dataloader_workers_with_random_reads_resume_mid_epoch_to_the_same_weights(tmp_path):
    """Augmentation drawn in DataLoader workers: the whole run's checkpoint of step 3 (mid-epoch), resumed into a folder
    of its own, ends bit-identical to the whole run (that the worker count changes no draw:
    test_augmentation_depends_on_seed_epoch_and_position_only)."""
    common = ["--dataset", "tests.helpers.data:noisy_digits", "--model", "mnist_cnn", "--max_steps", "8",
              "--global_batch_size", "64", "--per_device_batch_size", "16", "--loader", "dataloader",
              "--checkpointing_steps", "3", "--num_workers", "1"]
    train_ranks([*common, "--output_dir", str(tmp_path / "whole")])
    summaries = train_ranks([*common, "--output_dir", str(tmp_path / "resumed"),
                             "--resume_from_checkpoint", str(tmp_path / "whole" / "checkpoints" / "step_00000003")])
    assert summaries[0]["resumed_from_step"] == 3 and summaries[0]["loader"] == "dataloader"
    assert summaries[0]["data_source"] == "map_style"
    whole, resumed = load_weights(tmp_path / "whole"), load_weights(tmp_path / "resumed")
    assert all(torch.equal(whole[k], resumed[k]) for k in whole)


def test_resume_on_another_world_size_continues_with_the_same_global_batches(tmp_path):
    """Saved by 2 ranks mid-epoch, resumed by 1: every later optimizer step trains on the same samples."""
    from accel_ddp.config import TrainConfig

    def served(world: int, out: str, resume: str | None = None) -> list[list[int]]:
        def run() -> list[list[int]]:
            model = helpers_data.IndexRecorder()
            cfg = TrainConfig(global_batch_size=8, per_device_batch_size=8 // world, epochs=2, seed=3,
                              optimizer="sgd", lr=0.1, checkpointing_steps="5", output_dir=str(tmp_path / out),
                              resume_from_checkpoint=resume)
            train(cfg, model=model, train_dataset=helpers_data.IndexDataset(100))
            return model.seen

        per_rank = run_ranks(run, world_size=world)
        return [sorted(i for rank in per_rank for i in rank[step]) for step in range(len(per_rank[0]))]

    whole = served(2, "whole")  # 12 steps per epoch, 24 in all
    resumed = served(1, "moved", resume=str(tmp_path / "whole" / "checkpoints" / "step_00000015"))  # in epoch 1
    assert len(whole) == 24 and resumed == whole[15:]
    assert read_summary(tmp_path / "moved")["world_size"] == 1
    assert read_summary(tmp_path / "moved")["resumed_from_step"] == 15


def test_device_loader_holds_the_set_normalised_where_it_fits_with_the_same_bits():
    """Without augmentation, the uint8 set is normalised once into float32 where that fits the budget: a batch is then
    one gather (benchmarks/ops_per_step.py), with the bits of normalising each batch; over the budget it stays uint8."""
    images = torch.randint(0, 256, (64, 3, 4, 4), dtype=torch.uint8)
    data = InMemoryDataset(images, torch.arange(64) % 5, mean=(0.4, 0.5, 0.6), std=(0.2, 0.25, 0.3), scale=255.0)
    per_batch = DeviceLoader(data, 8, 16, seed=3, rank=1, world_size=2)
    normalised = DeviceLoader(data, 8, 16, seed=3, rank=1, world_size=2, normalised_max_mb=1)
    half = data.normalised_nbytes / 2**21  # MiB: half of what the float32 copy takes
    too_small = DeviceLoader(data, 8, 16, seed=3, rank=1, world_size=2, normalised_max_mb=half)
    assert (per_batch.data.inputs.dtype, normalised.data.inputs.dtype, too_small.data.inputs.dtype) == (
        torch.uint8, torch.float32, torch.uint8)
    for (x, y), (nx, ny) in zip(per_batch, normalised, strict=True):
        assert torch.equal(x, nx) and torch.equal(y, ny)
    augmented = InMemoryDataset(images, torch.arange(64) % 5, scale=255.0, augment="crop_flip")
    assert DeviceLoader(augmented, 8, 16, seed=3, normalised_max_mb=1).data.inputs.dtype == torch.uint8  # crop first


def test_the_device_and_host_loaders_share_one_typed_contract():
    """One constructor (GlobalBatchLoader's) and one protocol (TrainLoader): built alike, the two loaders have the
    same layout and serve the same samples in the same micro-steps."""
    from accel_ddp.data.loaders import TrainLoader
    from accel_ddp.data.sampler import GlobalBatchLoader

    data = TensorDataset(torch.arange(44.0).view(44, 1), torch.zeros(44, dtype=torch.long))
    layout = {"per_device_batch_size": 2, "global_batch_size": 8, "seed": 3, "rank": 1, "world_size": 2}
    loaders = DeviceLoader(data, **layout), HostLoader(data, num_workers=0, **layout)
    for loader in loaders:
        assert isinstance(loader, GlobalBatchLoader) and isinstance(loader, TrainLoader)
        assert (len(loader), loader.steps_per_epoch, loader.accumulation, loader.device) == \
            (10, 5, 2, torch.device("cpu"))
        assert (loader.rank, loader.world_size, loader.seed, loader.per_device_batch_size) == (1, 2, 3, 2)
    device, host = ([batch[0].flatten().tolist() for batch in loader] for loader in loaders)
    assert device == host and len(device) == 10
    assert not isinstance(data, TrainLoader)
