"""The per-node agent (``adloader agent``) and the ``adloader`` command (composition root: agent.cli)."""
