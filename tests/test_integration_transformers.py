"""the transformers Trainer: `adloader.integrations.transformers.Trainer`, with the real framework on CPU (1 process, and 2 over gloo with a live agent). The
framework tier: `-m frameworks` selects it; it skips with the reason where the framework is absent
(`./run setup` installs the [frameworks] extra). What each run checks: tests/integration_train.py.
"""
from __future__ import annotations

import importlib.util

import pytest

from tests.integration_train import one_process, two_processes_with_agent

pytestmark = [pytest.mark.component, pytest.mark.frameworks,
              pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                                 reason="transformers is not installed (pip install -e '.[frameworks]' -c constraints-frameworks.txt)")]

RUNS = {"trainer": 2, "auto": 1}


def test_one_process(tmp_path):
    results = one_process("transformers", RUNS, str(tmp_path))
    for run in ("trainer", "auto"):      # trainer.evaluate() ran on an A-Dloader loader as well
        ev = results[0]["runs"][run]["eval"]
        assert ev["is_adloader"] and ev["steps"] == 192 // 4 and ev["workers"] >= 1, ev
        # the Trainer told the train loader its length: steps_left counts down to 0, withdrawn at the end
        r = results[0]["runs"][run]
        left, total = r["steps_left"], r["max_steps"]
        assert len(left) == total and total == (192 // 4) * (2 if run == "trainer" else 1), (run, total)
        assert all(v is not None and total - i - 2 <= v <= total - i for i, v in enumerate(left)), left
        assert r["steps_left_after"] is None
    assert all(v is None for v in results[0]["runs"]["torch"]["steps_left"])


def test_two_processes_gloo_with_a_live_agent(base, tmp_path):
    two_processes_with_agent("transformers", RUNS, base, str(tmp_path))


def test_a_run_resumed_mid_epoch_trains_the_rest_of_that_epoch_on_the_adloader_loader(tmp_path):
    """``train(resume_from_checkpoint=...)`` skips the batches already trained with Accelerate's
    ``skip_first_batches`` (``Trainer._inner_training_loop``), which built a torch DataLoader for the
    rest of the resumed epoch: no A-Dloader worker there, the train handle counting only the epochs
    after it (6 steps of the 8 trained). Now the rest of the epoch runs on an ``adloader.DataLoader``
    sharing the train loader's state: the same batches as the transformers Trainer's own resume, all
    8 counted. transformers' own ``skip_first_batches`` is back in place after ``train()``."""
    import os

    import torch
    import torch.utils.data as tud
    import transformers
    import transformers.trainer as hf_trainer

    from adloader.integrations.transformers import Trainer

    original_skip = hf_trainer.skip_first_batches

    class Samples(tud.Dataset):
        def __len__(self):
            return 24

        def __getitem__(self, i):
            return {"x": torch.tensor([float(i)]), "idx": torch.tensor(i), "pid": torch.tensor(os.getpid())}

    class Model(torch.nn.Module):
        def __init__(self, seen):
            super().__init__()
            self.lin, self.seen = torch.nn.Linear(1, 1), seen

        def forward(self, x, idx, pid):
            self.seen.append(([int(i) for i in idx], {int(p) for p in pid}))
            return {"loss": self.lin(x).pow(2).mean()}

    def train(cls, out, resume=None, **extra):
        seen = []
        args = transformers.TrainingArguments(
            output_dir=str(out), per_device_train_batch_size=4, num_train_epochs=2, use_cpu=True, report_to=[],
            logging_strategy="no", disable_tqdm=True, seed=3, learning_rate=0.01, save_strategy="steps",
            save_steps=4, remove_unused_columns=False)
        trainer = cls(model=Model(seen), args=args, train_dataset=Samples(), **extra)
        trainer.train(resume_from_checkpoint=resume)
        return trainer, seen

    ours, _ = train(Trainer, tmp_path / "a", adloader_num_workers=1)
    ours.adloader_loaders["train"].close()
    theirs, _ = train(transformers.Trainer, tmp_path / "t")
    resumed, seen = train(Trainer, tmp_path / "a2", resume=str(tmp_path / "a" / "checkpoint-4"), adloader_num_workers=1)
    _, reference = train(transformers.Trainer, tmp_path / "t2", resume=str(tmp_path / "t" / "checkpoint-4"))
    try:
        assert [ids for ids, _ in seen] == [ids for ids, _ in reference] and len(seen) == 8, (seen, reference)
        assert all(pids and os.getpid() not in pids for _, pids in seen), seen   # loaded by a worker
        assert resumed.adloader_loaders["train"].stats()["steps"] == 8
    finally:
        resumed.adloader_loaders["train"].close()
    assert hf_trainer.skip_first_batches is original_skip
