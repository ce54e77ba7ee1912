"""One rank of a tiny training run under a real framework, for tests/test_integration_*.py. Not a test
module. Usage (the environment carries RANK/WORLD_SIZE/LOCAL_RANK/MASTER_* for 2 processes):

    python -m tests.integration_train FRAMEWORK OUT_DIR [--release FILE]

FRAMEWORK: lightning | accelerate | transformers. Writes OUT_DIR/rank<R>.json with, per training run
("runs": hook / passed / auto / ...), every batch's sample ids, the pid of the process that loaded each
sample and whether it was loaded by an A-Dloader worker, the steps seen by the user's handle and by the
framework's own loader object, what a resize from another thread did, and the same run with torch's
DataLoader (num_workers=0) for the reference order. With --release it waits for that file (written by
the test once it has seen the job in `adloader status`) before closing the loaders and exiting.
"""
from __future__ import annotations

import faulthandler
import json
import os
import signal
import sys
import threading
import time


def stacks_on_sigusr1() -> None:
    """A rank that hangs prints every thread's stack on SIGUSR1 (run_ranks sends it before giving up);
    forked DataLoader workers inherit the handler. Set again after every Lightning fit: the trainer's
    teardown puts back the handlers Python knew of before the fit (SIG_DFL for SIGUSR1, which then
    kills the rank instead). Unregistered first: ``register`` of a registered signal keeps the handler
    it believes is installed."""
    faulthandler.unregister(signal.SIGUSR1)
    faulthandler.register(signal.SIGUSR1, all_threads=True)


stacks_on_sigusr1()

RANK = int(os.environ.get("RANK", "0"))
WORLD = int(os.environ.get("WORLD_SIZE", "1"))
N, BATCH, EPOCHS, SEED = 192, 4, 2, 1234
RESIZE_AT = 8           # steps of the user's handle before the other thread calls resize(2)

import torch  # noqa: E402  (the framework is imported first where a test needs it: lightning below)
import torch.utils.data as tud  # noqa: E402


def _from_adloader_worker() -> bool:
    f = sys._getframe(1)
    while f is not None:
        if f.f_globals.get("__name__") == "adloader._worker":
            return True
        f = f.f_back
    return False


class Points(tud.Dataset):
    """Sample i: features, a target, and where it was loaded (pid, whether in an A-Dloader worker)."""

    def __init__(self, as_dict: bool = False):
        self.as_dict = as_dict

    def __len__(self):
        return N

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        x = torch.randn(8, generator=g)
        y = x.sum().reshape(1)
        # the third: SIGTERM at its default here (a worker does not run the trainer's handlers)
        where = torch.tensor([os.getpid(), int(_from_adloader_worker()),
                              int(signal.getsignal(signal.SIGTERM) == signal.SIG_DFL)])
        if self.as_dict:
            return {"x": x, "labels": y, "idx": torch.tensor(i), "where": where}
        return x, y, torch.tensor(i), where


class Recorder:
    """Batches seen by the training step, per epoch."""

    def __init__(self):
        self.epoch = 0
        self.batches: list[dict] = []

    def add(self, idx, where):
        self.batches.append({"epoch": self.epoch, "idx": idx.flatten().tolist(),
                             "pid": where[:, 0].tolist(), "adl": where[:, 1].tolist(),
                             "sigterm_default": where[:, 2].tolist()})


class Resizer(threading.Thread):
    """From another thread, resize the user's handle to 2 once it has seen RESIZE_AT steps."""

    def __init__(self, get_loader):
        super().__init__(daemon=True)
        self.get_loader = get_loader
        self.result: dict = {}
        self.stop = False

    def run(self):
        while not self.stop:
            loader = self.get_loader()
            if loader is not None and loader.stats()["steps"] >= RESIZE_AT:
                self.result = {"at_step": loader.stats()["steps"], "returned": loader.resize(2)}
                return
            time.sleep(0.002)


def _summary(rec: Recorder, user, framework_obj, resizer: Resizer | None) -> dict:
    out = {"batches": rec.batches, "main_pid": os.getpid()}
    if user is not None:
        out.update(user_steps=user.stats()["steps"], user_workers=user.num_workers,
                   framework_steps=framework_obj.stats()["steps"],
                   framework_workers=framework_obj.num_workers,
                   framework_type=type(framework_obj).__name__,
                   framework_loader_is_adloader=type(getattr(framework_obj, "base_dataloader", framework_obj))
                   .__module__ == "adloader.dataloader",
                   framework_is_user=framework_obj is user,
                   shares_state=framework_obj.elastic_state is user.elastic_state,
                   num_workers_arg=vars(user)["num_workers"], requested=user.requested_workers,
                   resizes=user.stats()["resizes"])
    if resizer is not None:
        resizer.stop = True
        out["resize"] = resizer.result
    return out


# ---- Lightning ----------------------------------------------------------------------------------
def run_lightning() -> dict:
    import lightning as L      # imported before adloader: the "imported late" case of the issue

    class Module(L.LightningModule):
        def __init__(self, make_loader=None):
            super().__init__()
            self.net = torch.nn.Linear(8, 1)
            self.rec = Recorder()
            self.make_loader = make_loader
            self.loader = None

        def on_train_epoch_start(self):
            self.rec.epoch = self.current_epoch

        def training_step(self, batch, _):
            x, y, idx, where = batch
            self.rec.add(idx, where)
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

        def train_dataloader(self):
            self.loader = self.make_loader()
            return self.loader

    def fit(module, loader=None, epochs=EPOCHS, resize=True):
        trainer = L.Trainer(accelerator="cpu", devices=WORLD, strategy="ddp" if WORLD > 1 else "auto",
                            max_epochs=epochs, logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
        resizer = None
        if resize:
            resizer = Resizer(lambda: loader if loader is not None else module.loader)
            resizer.start()
        trainer.fit(module, train_dataloaders=loader)
        stacks_on_sigusr1()
        return trainer, resizer

    def gen():
        return torch.Generator().manual_seed(SEED)

    def torch_loader():
        # num_workers=1: under Lightning, torch's loader with num_workers=0 orders the second epoch
        # differently from a plain loop over it (torch's with workers, and this loader, agree with the loop)
        return tud.DataLoader(Points(), batch_size=BATCH, shuffle=True, generator=gen(), num_workers=1)

    runs = {}
    # built in the hook, adloader first imported there (after Lightning wrapped the DataLoader classes)
    def hook_loader():
        from adloader import DataLoader
        return DataLoader(Points(), batch_size=BATCH, shuffle=True, generator=gen(), num_workers=1, max_workers=2)

    module = Module(hook_loader)
    trainer, resizer = fit(module)
    runs["hook"] = _summary(module.rec, module.loader, trainer.train_dataloader, resizer)
    # passed to fit
    from adloader import DataLoader
    user = DataLoader(Points(), batch_size=BATCH, shuffle=True, generator=gen(), num_workers=1, max_workers=2)
    module = Module()
    trainer, resizer = fit(module, user)
    runs["passed"] = _summary(module.rec, user, trainer.train_dataloader, resizer)
    # num_workers="auto", passed to fit
    auto = DataLoader(Points(), batch_size=BATCH, shuffle=True, generator=gen(), num_workers="auto", max_workers=2)
    module = Module()
    trainer, _ = fit(module, auto, epochs=1, resize=False)
    runs["auto"] = _summary(module.rec, auto, trainer.train_dataloader, None)
    # the reference: torch's DataLoader, same seed
    module = Module(torch_loader)
    fit(module, resize=False)
    runs["torch"] = _summary(module.rec, None, None, None)
    return {"runs": runs, "handles": [user, auto]}


# ---- Accelerate ---------------------------------------------------------------------------------
def run_accelerate() -> dict:
    from accelerate import Accelerator
    from adloader import DataLoader
    from adloader.integrations.accelerate import prepare

    accelerator = Accelerator(cpu=True)

    def train(loader, epochs, use_adloader=True):
        model = torch.nn.Linear(8, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        if use_adloader:
            model, opt, prepared = prepare(accelerator, model, opt, loader)
        else:
            model, opt, prepared = accelerator.prepare(model, opt, loader)
        rec = Recorder()
        resizer = Resizer(lambda: loader) if use_adloader and vars(loader)["num_workers"] != "auto" else None
        if resizer:
            resizer.start()
        for epoch in range(epochs):
            rec.epoch = epoch
            for x, y, idx, where in prepared:
                rec.add(idx, where)
                loss = torch.nn.functional.mse_loss(model(x), y)
                accelerator.backward(loss)
                opt.step()
                opt.zero_grad()
        return _summary(rec, loader if use_adloader else None, prepared, resizer)

    def gen():
        return torch.Generator().manual_seed(SEED)

    user = DataLoader(Points(), batch_size=BATCH, shuffle=True, generator=gen(), num_workers=1, max_workers=2)
    auto = DataLoader(Points(), batch_size=BATCH, shuffle=True, generator=gen(), num_workers="auto", max_workers=2)
    runs = {"prepare": train(user, EPOCHS), "auto": train(auto, 1),
            "torch": train(tud.DataLoader(Points(), batch_size=BATCH, shuffle=True, generator=gen(), num_workers=1),
                           EPOCHS, use_adloader=False)}
    # accelerator.prepare alone swaps in torch's DataLoader: warned, once per process
    import warnings
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            plain = DataLoader(Points(), batch_size=BATCH, num_workers=1)
            accelerator.prepare(plain)
            plain.close()
    warned = [str(w.message) for w in caught if "adloader" in str(w.message)]
    return {"runs": runs, "handles": [user, auto], "plain_prepare_warnings": warned}


# ---- transformers Trainer -----------------------------------------------------------------------
def run_transformers() -> dict:
    import tempfile

    import transformers
    from adloader.integrations.transformers import Trainer

    class Model(torch.nn.Module):
        def __init__(self, rec):
            super().__init__()
            self.net = torch.nn.Linear(8, 1)
            self.rec = rec

        def forward(self, x, labels, idx, where):
            if self.training:
                self.rec.add(idx, where)
            return {"loss": torch.nn.functional.mse_loss(self.net(x), labels)}

    class Epochs(transformers.TrainerCallback):
        def __init__(self, rec):
            self.rec = rec

        def on_epoch_begin(self, args, state, control, **kw):
            self.rec.epoch = int(round(state.epoch or 0))

    def train(cls, epochs, torch_workers=0, **extra):
        rec = Recorder()
        args = transformers.TrainingArguments(
            output_dir=scratch, per_device_train_batch_size=BATCH,
            num_train_epochs=epochs, use_cpu=True, report_to=[], save_strategy="no", logging_strategy="no",
            disable_tqdm=True, seed=SEED, ddp_backend="gloo" if WORLD > 1 else None, learning_rate=0.01,
            dataloader_num_workers=torch_workers, per_device_eval_batch_size=BATCH)
        left: list = []        # the train loader's steps_left at each step (the Trainer told it its length)

        class Left(transformers.TrainerCallback):
            def on_step_begin(self, args, state, control, **kw):
                loader = getattr(trainer, "adloader_loaders", {}).get("train")
                left.append(loader.stats().get("steps_left") if loader is not None else None)

        trainer = cls(model=Model(rec), args=args, train_dataset=Points(as_dict=True),
                      callbacks=[Epochs(rec), Left()], **extra)
        resizer = None
        if extra and extra.get("adloader_num_workers") != "auto":
            resizer = Resizer(lambda: trainer.adloader_loaders.get("train"))
            resizer.start()
        trainer.train()
        user = trainer.adloader_loaders.get("train") if extra else None
        fw = trainer.callback_handler.train_dataloader if extra else None     # what the Trainer iterated
        summary = _summary(rec, user, fw, resizer)
        summary["steps_left"] = left
        summary["max_steps"] = trainer.state.max_steps
        summary["steps_left_after"] = user.stats().get("steps_left") if user is not None else None
        if extra:
            # the eval loader too: built by the Trainer, prepared, with an A-Dloader loader inside
            trainer.evaluate(eval_dataset=Points(as_dict=True))
            ev = trainer.adloader_loaders["eval"]
            summary["eval"] = {"steps": ev.stats()["steps"], "is_adloader": type(ev).__module__ == "adloader.dataloader",
                               "workers": ev.num_workers}
            ev.close()
        return summary, user

    # the Trainer's output_dir (nothing is saved there: save_strategy "no"), removed afterwards
    with tempfile.TemporaryDirectory(prefix="adl-fw-hf-") as scratch:
        run, user = train(Trainer, EPOCHS, adloader_num_workers=1, adloader_max_workers=2)
        auto_run, auto = train(Trainer, 1, adloader_num_workers="auto", adloader_max_workers=2)
        ref, _ = train(transformers.Trainer, EPOCHS, torch_workers=1)
    return {"runs": {"trainer": run, "auto": auto_run, "torch": ref}, "handles": [user, auto]}


def main() -> None:
    framework, out = sys.argv[1], sys.argv[2]
    release = sys.argv[sys.argv.index("--release") + 1] if "--release" in sys.argv else None
    result = {"lightning": run_lightning, "accelerate": run_accelerate,
              "transformers": run_transformers}[framework]()
    handles = result.pop("handles")
    result.update(rank=RANK, world=WORLD)
    tmp = os.path.join(out, f".rank{RANK}.json")
    with open(tmp, "w") as f:
        json.dump(result, f)
    os.replace(tmp, os.path.join(out, f"rank{RANK}.json"))
    if release:
        deadline = time.monotonic() + 120
        while not os.path.exists(release) and time.monotonic() < deadline:
            time.sleep(0.05)
    for h in handles:
        h.close()


if __name__ == "__main__":
    main()


def launch(framework: str, world: int, out: str, *, env: dict, release: str | None = None, port: int = 0):
    """Start the ranks of one run (as torchrun would: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT,
    TORCHELASTIC_RUN_ID); returns the Popen objects."""
    import subprocess

    from evaluation.slurm_cluster import free_port

    port = port or free_port()
    procs = []
    for rank in range(world):
        e = dict(env, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                 GROUP_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                 TORCHELASTIC_RUN_ID=f"fw-{framework}-{port}", OMP_NUM_THREADS="1",
                 TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", TRANSFORMERS_NO_ADVISORY_WARNINGS="1",
                 PYTHONUNBUFFERED="1")
        if world == 1:
            for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "TORCHELASTIC_RUN_ID"):
                e.pop(k)
        args = [sys.executable, "-m", "tests.integration_train", framework, out]
        if release:
            args += ["--release", release]
        procs.append(subprocess.Popen(args, env=e, stdout=open(f"{out}/log{rank}.txt", "w"),
                                      stderr=subprocess.STDOUT))
    return procs


# ---- what the tests check (tests/test_integration_*.py) -------------------------------------------
def check(results: list[dict], adloader_runs: dict[str, int], reference: str = "torch") -> None:
    """``results``: every rank's JSON. ``adloader_runs``: run name -> epochs, for the runs on
    adloader.DataLoader; ``reference``: the same training on torch's DataLoader, same seed."""
    world = len(results)
    steps_per_epoch = N // world // BATCH
    for res in results:
        ref = res["runs"][reference]["batches"]
        for name, epochs in adloader_runs.items():
            run = res["runs"][name]
            what = f"rank {res['rank']} run {name!r}"
            batches = run["batches"]
            # training completed, and the user's handle and the framework's loader both counted it
            assert len(batches) == epochs * steps_per_epoch, what
            assert run["user_steps"] == run["framework_steps"] == len(batches), what
            assert run["shares_state"] and run["framework_loader_is_adloader"], what
            # every sample was loaded by an A-Dloader worker process
            assert all(all(b["adl"]) for b in batches), what
            assert all(p != run["main_pid"] for b in batches for p in b["pid"]), what
            # ...none of them with the trainer's SIGTERM handler (Lightning's, inherited at the fork)
            assert all(all(b["sigterm_default"]) for b in batches), what
            # batches equal torch's for the same seed
            assert [b["idx"] for b in batches] == [b["idx"] for b in ref[:len(batches)]], what
            if "resize" in run:
                # resize(2) from another thread mid-epoch: effective at once in the framework's loader
                assert run["resize"].get("returned") == 2, (what, run["resize"])
                assert run["user_workers"] == run["framework_workers"] == 2 and run["resizes"] >= 1, what
                assert len({p for b in batches if b["epoch"] == epochs - 1 for p in b["pid"]}) == 2, what
            else:
                assert run["num_workers_arg"] == "auto" and run["requested"] >= 1, what
    if world > 1:
        for name, epochs in adloader_runs.items():
            for epoch in range(epochs):
                shards = [[i for b in res["runs"][name]["batches"] if b["epoch"] == epoch for i in b["idx"]]
                          for res in results]
                assert sorted(sum(shards, [])) == list(range(N)), (name, epoch)   # disjoint, complete
            for res in results:
                per_epoch = [[i for b in res["runs"][name]["batches"] if b["epoch"] == e for i in b["idx"]]
                             for e in range(epochs)]
                assert all(a != b for a, b in zip(per_epoch, per_epoch[1:])), f"{name}: not reshuffled"


def _dump_stacks(procs) -> None:
    """Every live rank and its DataLoader workers print their threads' stacks into the rank's log."""
    import psutil

    from evaluation.slurm_cluster import signal_pids

    pids = []
    for p in procs:
        if p.poll() is None:
            pids.append(p.pid)
            try:
                pids += [c.pid for c in psutil.Process(p.pid).children(recursive=True)]
            except psutil.Error:
                pass
    signal_pids(pids, signal.SIGUSR1)
    if pids:
        time.sleep(1.0)


def run_ranks(framework: str, world: int, out: str, env: dict, agent=None, timeout_s: float = 240) -> list[dict]:
    """Run ``world`` ranks to the end; with ``agent`` (tests.agentd_support.AgentProc), check that the
    job is in `adloader status` with its ranks before letting them close their loaders."""
    from tests.conftest import wait_for

    release = os.path.join(out, "release") if agent is not None else None
    procs = launch(framework, world, out, env=env, release=release)
    try:
        files = [os.path.join(out, f"rank{r}.json") for r in range(world)]
        deadline = time.monotonic() + timeout_s
        while not all(os.path.exists(f) for f in files):
            # a rank that exited (even with 0) without its file fails the run at once
            gone = [r for r, p in enumerate(procs) if p.poll() is not None and not os.path.exists(files[r])]
            if gone or time.monotonic() > deadline:
                _dump_stacks(procs)
                logs = "\n".join(open(os.path.join(out, f"log{r}.txt")).read()[-8000:] for r in range(world))
                codes = ", ".join(f"rank {r}: {'running' if p.poll() is None else f'exit {p.returncode}'}"
                                  for r, p in enumerate(procs))
                why = f"rank(s) {gone} exited without a result" if gone else f"no result in {timeout_s:.0f} s"
                raise AssertionError(f"{framework} x{world}: {why} ({codes})\n{logs}")
            time.sleep(0.1)
        if agent is not None:
            pids = sorted(p.pid for p in procs)
            job = wait_for(lambda: next((j for j in agent.status()["jobs"] if j["ranks"] == world), None), 30,
                           what=f"the {framework} job with {world} ranks in `adloader status`")
            assert sorted(job["pids"]) == pids
            with open(release, "w"):
                pass
        for p in procs:
            assert p.wait(60) == 0
        return [json.load(open(f)) for f in files]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def one_process(framework: str, runs: dict[str, int], out: str) -> list[dict]:
    """The 1-process test of a framework (no agent)."""
    from tests.conftest import repo_env

    results = run_ranks(framework, 1, out, repo_env(ADLOADER_DISABLE="1"))
    check(results, runs)
    return results


def two_processes_with_agent(framework: str, runs: dict[str, int], base: str, out: str) -> None:
    """The 2-process (gloo) test of a framework, with a live agent (policy none: no directive moves
    the worker counts the test checks)."""
    from tests.agentd_support import AgentProc
    from tests.conftest import repo_env

    agent = AgentProc(base, "--policy", "none", "--tick-s", "0.3").start()
    try:
        env = repo_env(ADLOADER_ENDPOINT=agent.endpoint)
        for k in ("SLURM_JOB_ID", "ADLOADER_JOB_ID"):
            env.pop(k, None)
        results = run_ranks(framework, 2, out, env, agent=agent)
    finally:
        agent.stop()
    check(results, runs)
