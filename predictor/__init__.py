"""Throughput predictor: observations of a running job -> throughput curve -> max useful workers.

No sockets, no cgroups, never imports ``agent``. See ``predictor.observation`` (the input record),
``predictor.curve`` (the output every policy consumes), ``predictor.bank`` (one model per job:
``PredictorBank``) and ``predictor.prior`` (the learned part, refitted from the measured corpus in
``predictor/data/corpus.jsonl``).
"""
from predictor.bank import PredictorBank
from predictor.curve import ThroughputCurve
from predictor.observation import BadObservation, Observation

__all__ = ["PredictorBank", "ThroughputCurve", "Observation", "BadObservation"]
