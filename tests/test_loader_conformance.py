"""adloader.DataLoader next to torch's own DataLoader, side by side, where issue 12's conformance run
found them apart: DataPipe sharding and per-epoch reseeding, the generator draws of persistent
iterators, torch's error wording (timeout, killed worker, out of file descriptors), and the documented
per-batch seeding that overrides a seed set in ``worker_init_fn``."""
from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.utils.data as tud

from adloader import DataLoader
from tests.loader_datasets import collate_pin_containers

pytestmark = [pytest.mark.component, pytest.mark.filterwarnings("ignore:This DataLoader will create"),
              pytest.mark.filterwarnings("ignore::UserWarning:torch.utils.data.datapipes")]
REPO = Path(__file__).resolve().parent.parent


def _epochs(loader, n):
    return [[b.tolist() for b in loader] for _ in range(n)]


def _datapipe(n=24):
    from torch.utils.data.datapipes.iter import IterableWrapper

    return IterableWrapper(range(n)).shuffle().sharding_filter()


@pytest.mark.parametrize("workers,persistent", [(0, False), (2, False), (2, True), (3, True)])
def test_datapipe_is_sharded_and_reshuffled_per_epoch_as_torch_does(workers, persistent):
    kw = dict(batch_size=4, num_workers=workers, persistent_workers=persistent)
    ref = _epochs(tud.DataLoader(_datapipe(), generator=torch.Generator().manual_seed(7), **kw), 3)
    dl = DataLoader(_datapipe(), generator=torch.Generator().manual_seed(7), max_workers=max(workers, 1), **kw)
    got = _epochs(dl, 3)
    dl.close()
    assert got == ref
    for epoch in got:                                   # every sample once per epoch, not once per worker
        assert sorted(x for b in epoch for x in b) == list(range(24))
    assert got[0] != got[1] != got[2]                   # reseeded from the loader's generator each epoch


def test_datapipe_reshards_when_the_worker_count_changes_between_epochs():
    dl = DataLoader(_datapipe(), batch_size=4, num_workers=2, max_workers=3, persistent_workers=True,
                    generator=torch.Generator().manual_seed(1))
    first = [b.tolist() for b in dl]
    dl.resize(3)
    second = [b.tolist() for b in dl]
    dl.close()
    for epoch in (first, second):
        assert sorted(x for b in epoch for x in b) == list(range(24))


@pytest.mark.parametrize("workers", [0, 2])
def test_map_datapipe_batches_equal_torch(workers):
    from torch.utils.data.datapipes.map import SequenceWrapper

    kw = dict(batch_size=3, shuffle=True, num_workers=workers)
    ref = _epochs(tud.DataLoader(SequenceWrapper(list(range(10))), generator=torch.Generator().manual_seed(2), **kw), 2)
    dl = DataLoader(SequenceWrapper(list(range(10))), generator=torch.Generator().manual_seed(2), max_workers=2, **kw)
    assert _epochs(dl, 2) == ref


class Numbers(tud.Dataset):
    def __init__(self, n: int = 12):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return i


@pytest.mark.parametrize("persistent", [False, True])
def test_sampler_order_every_epoch_equals_torch_with_and_without_persistent_workers(persistent):
    # torch's persistent iterator draws its base seed once, at creation; later epochs draw only the
    # sampler's seed: the same generator must give the same order from the second epoch on
    kw = dict(batch_size=4, shuffle=True, num_workers=2, persistent_workers=persistent)
    ref = _epochs(tud.DataLoader(Numbers(), generator=torch.Generator().manual_seed(3), **kw), 3)
    dl = DataLoader(Numbers(), generator=torch.Generator().manual_seed(3), max_workers=2, **kw)
    assert _epochs(dl, 3) == ref
    dl.close()


@pytest.mark.parametrize("persistent", [False, True])
def test_an_epoch_left_after_a_resize_moves_the_generator_as_torch_s_loader_with_the_new_count(persistent):
    # documented deviation (docs/users.md): how far a left epoch's sampler was drawn is the prefetch
    # window of the count in effect when it was left; RandomSampler draws again when it runs out
    def run(cls, workers, resize_to=None):
        dl = cls(Numbers(15), batch_size=2, shuffle=True, num_workers=workers, persistent_workers=persistent,
                 generator=torch.Generator().manual_seed(0), **({} if cls is tud.DataLoader else dict(max_workers=3)))
        out = [[b.tolist() for b in dl]]
        left = []
        for b in dl:
            left.append(b.tolist())
            if len(left) == 1 and resize_to is not None:
                dl.resize(resize_to)
            if len(left) == 3:
                break
        out += [left, [b.tolist() for b in dl]]
        return out

    assert run(DataLoader, 2, resize_to=3) == run(tud.DataLoader, 3)
    assert run(DataLoader, 2) == run(tud.DataLoader, 2)


@pytest.mark.parametrize("plan", [(2, 0, 2, 2), (2, 0, 0, 1), (2, 1, 0, 2)])
def test_persistent_loader_set_to_no_workers_for_an_epoch_keeps_torch_order(plan):
    # torch: an epoch with num_workers = 0 runs a fresh single-process iterator (its own base seed);
    # the persistent worker iterator, and the base seed it drew when created, are kept for the epochs
    # with workers after it. `num_workers = n` between epochs is resize(n) here.
    def run(cls, **kw):
        dl = cls(Numbers(), batch_size=4, shuffle=True, num_workers=2, persistent_workers=True,
                 generator=torch.Generator().manual_seed(3), **kw)
        out = []
        for n in plan:
            dl.num_workers = n
            out.append([b.tolist() for b in dl])
        return out

    assert run(DataLoader, max_workers=2) == run(tud.DataLoader)


class WorkerSeeds(tud.Dataset):
    """Each sample: its index and ``get_worker_info().seed`` (-1 in the main process)."""

    def __len__(self):
        return 8

    def __getitem__(self, i):
        info = tud.get_worker_info()
        return i, info.seed if info is not None else -1


@pytest.mark.parametrize("seeded", [True, False])
def test_persistent_workers_started_in_an_epoch_begun_without_workers_are_replaced_by_torch_s_next_epoch(seeded):
    # torch: an epoch begun with num_workers = 0 is a fresh in-process iterator; the persistent worker
    # iterator is created at the next epoch with workers, drawing a new base seed (its workers' seed
    # is base_seed + worker_id). Here the epoch begun without workers was resized up after its first
    # batch; its workers had that epoch's base seed and were kept: every later epoch's workers saw
    # another get_worker_info().seed (and worker_init_fn another RNG) than torch's.
    def run(cls, **kw):
        if not seeded:
            torch.manual_seed(5)
        dl = cls(WorkerSeeds(), batch_size=2, shuffle=True, num_workers=2, persistent_workers=True,
                 generator=torch.Generator().manual_seed(3) if seeded else None, collate_fn=list, **kw)
        order, seeds = [], []
        for epoch, n in enumerate((0, 2, 2)):
            dl.num_workers = n
            got = []
            for b in dl:
                got.append(b)
                if epoch == 0 and len(got) == 1 and cls is DataLoader:
                    dl.resize(2)
            order.append([[i for i, _ in b] for b in got])
            seeds.append({s for b in got for _, s in b})
        getattr(dl, "close", lambda: None)()
        return order, seeds

    order, seeds = run(DataLoader, max_workers=2)
    ref_order, ref_seeds = run(tud.DataLoader)
    assert order == ref_order
    for epoch in (1, 2):        # the workers that ran the batches are torch's (which ran which may differ)
        assert seeds[epoch] and seeds[epoch] <= ref_seeds[epoch], epoch


@pytest.mark.parametrize("workers", [0, 2])
def test_a_state_at_an_epochs_last_batch_resumes_the_next_epoch_with_the_generator_where_the_run_left_it(workers):
    # a loop that knows the epoch's length (Lightning's fetcher) takes its last batch and never asks for
    # the StopIteration; a state saved there resumes at the next epoch. The replay ran the sampler to its
    # end, where RandomSampler draws once more; without workers nothing had asked it past the last batch
    # (torch's in-process iterator neither), so the resumed run's later epochs were shuffled differently
    def loader():
        return DataLoader(Numbers(), batch_size=4, shuffle=True, num_workers=workers, max_workers=2,
                          generator=torch.Generator().manual_seed(1))

    dl = loader()
    it = iter(dl)
    first = [next(it).tolist() for _ in range(3)]       # all of epoch 0, no StopIteration asked for
    state = dl.state_dict()
    rest = _epochs(dl, 2)
    ref = tud.DataLoader(Numbers(), batch_size=4, shuffle=True, num_workers=workers,
                         generator=torch.Generator().manual_seed(1))
    ref_it = iter(ref)
    assert [next(ref_it).tolist() for _ in range(3)] == first and _epochs(ref, 2) == rest
    resumed = loader()
    resumed.load_state_dict(state)
    assert _epochs(resumed, 2) == rest
    dl.close(), resumed.close()


@pytest.mark.parametrize("workers", [0, 2])
def test_a_draw_between_iter_and_the_first_next_comes_before_the_samplers_as_in_torch(workers):
    # torch's in-process iterator draws the sampler's first batch at the first next(), its worker
    # iterator when it is created; without workers this loader drew it at iter(): with the global
    # generator, a draw in between (Lightning's on_train_epoch_start hook) shuffled the epoch differently
    def run(cls, **kw):
        torch.manual_seed(7)
        dl = cls(Numbers(), batch_size=4, shuffle=True, num_workers=workers, **kw)
        out = []
        for _ in range(2):
            it = iter(dl)
            torch.rand(3)
            out.append([b.tolist() for b in it])
        getattr(dl, "close", lambda: None)()
        return out

    assert run(DataLoader, max_workers=2) == run(tud.DataLoader)


@pytest.mark.parametrize("at", [1, 2])
def test_a_persistent_loader_resumed_in_an_epoch_run_without_workers_keeps_its_worker_iterator_s_seed(at):
    # epochs 0 and 2 with workers, epoch 1 without (num_workers = 0), saved after `at` of its 2 batches
    # (2: its last, no StopIteration asked for, as Lightning's fetcher does). The state held only that
    # epoch's own base seed (an in-process iterator's), so a resumed run drew a new one for epoch 2
    # where torch's loader keeps its persistent worker iterator's: epoch 2 was shuffled differently
    # and its workers had other seeds
    def loader(cls, **kw):
        return cls(WorkerSeeds(), batch_size=4, shuffle=True, num_workers=2, persistent_workers=True,
                   generator=torch.Generator().manual_seed(3), collate_fn=list, **kw)

    def order(batches):             # (which worker ran a batch, so its seed, may differ from torch's)
        return [[i for i, _ in b] for b in batches]

    ref = loader(tud.DataLoader)
    full = [list(ref)]
    ref.num_workers = 0
    it = iter(ref)
    full.append([next(it) for _ in range(at)] + (list(it) if at < 2 else []))
    ref.num_workers = 2
    full.append(list(ref))
    dl = loader(DataLoader, max_workers=2)
    assert order(dl) == order(full[0])
    dl.num_workers = 0
    it = iter(dl)
    assert [next(it) for _ in range(at)] == full[1][:at]      # in-process: seed -1
    state = dl.state_dict()
    dl.close()
    resumed = loader(DataLoader, max_workers=2)
    resumed.load_state_dict(state)
    if at < 2:                      # (at its last batch the state resumes at the next epoch)
        resumed.num_workers = 0
        assert list(resumed) == full[1][at:]
        resumed.num_workers = 2
    after = list(resumed)
    resumed.close()
    assert order(after) == order(full[2])
    assert {s for b in after for _, s in b} <= {s for b in full[2] for _, s in b}      # torch's workers' seeds


def test_persistent_loader_resumed_between_and_within_epochs_keeps_torch_order():
    kw = dict(batch_size=2, shuffle=True, num_workers=2, persistent_workers=True, max_workers=2)
    ref = _epochs(DataLoader(Numbers(), generator=torch.Generator().manual_seed(9), **kw), 3)
    dl = DataLoader(Numbers(), generator=torch.Generator().manual_seed(9), **kw)
    list(dl)
    between = dl.state_dict()
    it = iter(dl)
    head = [next(it).tolist() for _ in range(2)]
    within = dl.state_dict()
    dl.close()
    assert head == ref[1][:2] and within["base_seed_drawn"] is False and between["base_seed_drawn"] is False
    for state, skip in ((between, 0), (within, 2)):
        again = DataLoader(Numbers(), generator=torch.Generator().manual_seed(12345), **kw)
        again.load_state_dict(state)
        assert [b.tolist() for b in again] == ref[1][skip:]
        assert [b.tolist() for b in again] == ref[2]
        again.close()


class Sleepy(tud.Dataset):
    """Each fetch lasts until ``release`` is set (at most 30 s): longer than any timeout, however slow
    the machine; the test releases it once the timeout has fired, so no shutdown waits out a sleep."""

    def __init__(self):
        import multiprocessing

        self.release = multiprocessing.Event()

    def __len__(self):
        return 2

    def __getitem__(self, i):
        self.release.wait(30.0)
        return i


def test_timeout_error_reads_as_torch_s():
    texts = []
    for cls in (tud.DataLoader, DataLoader):
        ds = Sleepy()
        dl = cls(ds, batch_size=None, num_workers=1, timeout=1)
        with pytest.raises(RuntimeError) as e:
            next(iter(dl))
        texts.append(str(e.value))
        ds.release.set()
        del dl
    assert texts[0] == texts[1] == "DataLoader timed out after 1 seconds"


class KillsItself(tud.Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, i):
        os.kill(os.getpid(), signal.SIGKILL)


class ShardKilledMidway(tud.IterableDataset):
    def __iter__(self):
        for i in range(1000):
            if i == 3 and tud.get_worker_info().id == 0:
                os.kill(os.getpid(), signal.SIGKILL)
            yield i


def test_dead_worker_errors_carry_torch_s_words():
    # torch: "DataLoader worker (pid(s) N) exited unexpectedly" (its queue read) or "DataLoader worker
    # (pid N) is killed by signal: Killed." (its SIGCHLD handler), whichever notices first
    torch_words = r"DataLoader worker \(pid(\(s\))? \d+\) (exited unexpectedly|is killed by signal: Killed\.)"
    with pytest.raises(RuntimeError) as e:
        list(tud.DataLoader(KillsItself(), batch_size=None, num_workers=1))
    assert re.search(torch_words, str(e.value)), str(e.value)
    for ds, kw in ((KillsItself(), dict(batch_size=None)), (ShardKilledMidway(), dict(batch_size=2))):
        with pytest.raises(RuntimeError) as e:
            list(DataLoader(ds, num_workers=2, max_workers=2, **kw))
        text = str(e.value)
        assert re.search(r"DataLoader worker \(pid\(s\) \d+\) exited unexpectedly", text), text
        assert re.search(r"DataLoader worker \(pid \d+\) is killed by signal: Killed\.", text), text


FD_SCRIPT = textwrap.dedent('''
    import resource, sys, torch, torch.utils.data as tud
    sys.path.insert(0, sys.argv[1])
    from adloader import DataLoader
    class ManyTensors(tud.Dataset):
        def __len__(self): return 400
        def __getitem__(self, i): return {f"k{j}": torch.full((3,), i) for j in range(40)}
    resource.setrlimit(resource.RLIMIT_NOFILE, (int(sys.argv[2]), int(sys.argv[2])))
    keep = []
    try:
        for b in DataLoader(ManyTensors(), batch_size=None, num_workers=2, timeout=60):
            keep.append(b)                      # every batch holds 40 shared-memory descriptors
    except Exception as e:
        print(type(e).__name__, e)
''')


@pytest.mark.parametrize("limit", [60, 200])
def test_running_out_of_file_descriptors_gives_torch_s_advice(tmp_path, limit):
    # 60: the kernel drops the descriptors passed with a batch (MSG_CTRUNC); 200: they arrive but
    # cannot be duplicated into tensors. Either way the batch fails with torch's advice, no hang.
    script = tmp_path / "fds.py"
    script.write_text(FD_SCRIPT)
    out = subprocess.run([sys.executable, str(script), str(REPO), str(limit)], capture_output=True, text=True,
                         timeout=120).stdout
    assert "Too many open files. Communication with the workers is no longer possible." in out, out[-2000:]
    assert "`ulimit -n`" in out and "set_sharing_strategy('file_system')" in out


class Draws(tud.Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, i):
        return torch.tensor([random.randrange(1 << 30), torch.initial_seed() & 0xFFFFFFFF])


def seed_python_per_worker(worker_id):
    random.seed(1000 + worker_id)


def test_documented_deviation_per_batch_seeding_overrides_worker_init_fn():
    """A seed set in worker_init_fn does not reach __getitem__ and torch.initial_seed() is a per-batch
    value (docs/users.md, the DataLoader docstring): the batches equal num_workers=0's, whatever
    worker ran them; torch keeps the worker_init_fn seed and one initial seed per worker."""
    def run(cls, workers, **kw):
        dl = cls(Draws(), batch_size=2, num_workers=workers, generator=torch.Generator().manual_seed(5),
                 worker_init_fn=seed_python_per_worker if workers else None, **kw)
        return [b.tolist() for b in dl]

    ours = run(DataLoader, 2, max_workers=2)
    assert ours == run(DataLoader, 0)
    seeds = [row[1] for b in ours for row in b]
    assert len(set(seeds)) == 4 and seeds[0::2] == seeds[1::2]          # one per batch
    theirs = run(tud.DataLoader, 2)
    assert len({row[1] for b in theirs for row in b}) == 2              # one per worker
    random.seed(1000)
    assert theirs[0][0][0] == random.randrange(1 << 30)                 # worker 0 kept its init seed
    for doc in (REPO / "docs" / "users.md", REPO / "adloader" / "dataloader.py"):
        text = doc.read_text()
        assert "worker_init_fn" in text and "initial_seed()" in text, doc


DIST_SCRIPT = textwrap.dedent('''
    import json, sys, torch, torch.distributed as dist, torch.utils.data as tud
    sys.path.insert(0, sys.argv[1])
    from torch.utils.data.datapipes.iter import IterableWrapper
    from adloader import DataLoader
    rank, init = int(sys.argv[2]), sys.argv[3]
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    out = {}
    for name, cls in (("torch", tud.DataLoader), ("adloader", DataLoader)):
        pipe = IterableWrapper(range(40)).shuffle().sharding_filter()
        # each rank its own generator: the shared seed is broadcast from rank 0, as torch does
        dl = cls(pipe, batch_size=4, num_workers=2, generator=torch.Generator().manual_seed(100 + rank))
        out[name] = [[b.tolist() for b in dl] for _ in range(2)]
    dist.destroy_process_group()
    print(json.dumps(out))
''')


def test_datapipe_in_a_two_rank_gloo_run_shards_over_ranks_and_workers_as_torch(tmp_path):
    script = tmp_path / "dist.py"
    script.write_text(DIST_SCRIPT)
    init = f"file://{tmp_path / 'rendezvous'}"
    procs = [subprocess.Popen([sys.executable, str(script), str(REPO), str(r), init], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in range(2)]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=240)
        assert p.returncode == 0, err[-3000:]
        outs.append(json.loads(out.strip().splitlines()[-1]))
    for rank_out in outs:
        assert rank_out["adloader"] == rank_out["torch"]
    for epoch in range(2):                  # the ranks split one shuffled order: every sample once
        seen = [x for o in outs for b in o["adloader"][epoch] for x in b]
        assert sorted(seen) == list(range(40))


def _pinned_view(batch):
    """What a training step can see of a pinned batch: every container's type and extra state, and
    which leaves were pinned."""
    enc, grouped, whole, pair = batch["enc"], batch["grouped"], batch["whole"], batch["pair"]
    return (type(batch).__name__, type(enc).__name__, getattr(enc, "extra", None), enc["ids"].pinned,
            type(grouped).__name__, getattr(grouped, "default_factory", None), grouped["ids"][0].pinned,
            type(whole).__name__, getattr(whole, "pinned_whole", False), type(pair).__name__, pair[0].pinned, pair[1])


@pytest.mark.parametrize("workers", [0, 1])
def test_pin_memory_rebuilds_batch_containers_as_torch_does(monkeypatch, workers):
    # with an accelerator, a batch is pinned by torch's pin_memory(): it asks an object with its own
    # pin_memory() first (a TensorDict is a mapping that pins itself), copies a mutable mapping or
    # sequence so that its type and extra state survive (a defaultdict's factory, transformers'
    # BatchEncoding), and keeps a tuple's type. Faked here: no accelerator on this machine.
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    kw = dict(batch_size=2, collate_fn=collate_pin_containers, pin_memory=True)
    ref = [_pinned_view(b) for b in tud.DataLoader(list(range(4)), **kw)]
    assert ref[0][3] and ref[0][4:7] == ("defaultdict", list, True) and ref[0][7:9] == ("PinnableMapping", True)
    dl = DataLoader(list(range(4)), num_workers=workers, **kw)
    assert [_pinned_view(b) for b in dl] == ref
    dl.close()


@pytest.mark.parametrize("workers", [0, 1])
def test_profiler_trace_names_each_next_as_torch_s_iterators_do(workers):
    # torch's iterators wrap every next() in record_function("enumerate(DataLoader)#<iterator>.__next__");
    # TensorBoard's profiler plugin and other trace tools count those ranges as DataLoader time, so
    # without them a profiled job's data wait vanished from its step-time breakdown
    from torch.profiler import ProfilerActivity, profile

    def ranges(cls):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in cls(list(range(6)), batch_size=2, num_workers=workers):
                pass
        return sorted(e.name for e in prof.events() if e.name.startswith("enumerate(DataLoader)#"))

    ref = ranges(tud.DataLoader)
    assert len(ref) == 4        # three batches and the next() that ends the epoch
    assert ranges(DataLoader) == ref
