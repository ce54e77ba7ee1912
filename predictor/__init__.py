"""Throughput predictor: observations of a running job -> throughput curve -> max useful workers.

No sockets, no cgroups, never imports ``agent``. See ``predictor.observation`` (the input record)
and ``predictor.curve`` (the output every policy consumes).
"""
