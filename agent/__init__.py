"""The per-node agent (``adloader agent``) and the ``adloader`` command (composition root: agent.cli)."""

# Read by adloader/__init__.py: the agent imports adloader's torch-free modules (protocol, env) and
# must start on a node without torch, so importing them from here must not import torch.
TORCH_FREE = True
