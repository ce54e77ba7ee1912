"""Glue for training frameworks that build or wrap the DataLoader themselves. One small module per
framework, imported only by a script that uses it (``import adloader`` never imports these):

- ``adloader.integrations.accelerate``: ``prepare(accelerator, *objects)``, Accelerate's ``prepare``
  that keeps an ``adloader.DataLoader`` inside Accelerate's shard or dispatcher wrapper.
- ``adloader.integrations.transformers``: ``AdloaderTrainerMixin`` / ``Trainer``, the transformers
  ``Trainer`` with its train/eval/test loaders built as ``adloader.DataLoader``.
- ``adloader.integrations.lightning``: ``StepsLeft``, a callback that tells the train loaders the
  batches the run has left (``set_total_steps``). Lightning needs nothing else: it rebuilds
  ``adloader.DataLoader`` itself (see ``adloader.DataLoader``'s docstring, "Rebuilt by a framework").
"""
