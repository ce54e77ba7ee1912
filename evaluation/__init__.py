"""Evaluation: everything that measures the daemon, beside it (``agent/`` is the daemon alone).

Imported lazily by ``adloader bench``, ``adloader demo`` and ``adloader simulate``; the agent never
imports it. Each benchmark is a command that prints a table and writes JSON.

``adloader bench`` / ``adloader demo`` (co-located real training jobs under each policy, side by side):
    catalog.py      job kinds (catalog.toml) and their calibration on this machine
    jobproc.py      one job process (adloader.DataLoader over generated JPEGs, emulated or CUDA step)
    harness.py      scenarios, phases (agent + jobs + events), progress files -> records -> metrics
    oracle.py       best static allocation from measured curves (exact knapsack)
    oracle_agent.py the real agent with the oracle's plan as its policy
    metrics.py      metric formulas (pure)
    report.py       medians over repeats, ratios, goals, markdown/JSON, the progress display
    plots.py        PNG plots (matplotlib, Agg): ``python -m evaluation.plots BENCH.json [OUT_DIR]``
    setup.py        what bench and demo share: node facts, calibration, the run itself
``adloader simulate``:
    simulate.py     trace-driven simulation of the policies over many nodes
Component benchmarks (``python -m evaluation.<name> --help``):
    loader_bench.py        adloader.DataLoader against torch's, resize and recovery costs
    controller_bench.py    one controller tick with many jobs (policy, predictor, diff)
    agent_bench.py         the agent's socket, collector and tick under many clients
    predictor_corpus.py    measures the predictor's corpus (predictor/data/corpus.jsonl)
    predictor_accuracy.py  leave-one-job-out accuracy of the predictor; writes its validation verdict
    phase_noise.py         what kind of noise moved a bench run's phases (the jobs' cost per phase)
    best_plan.py           the best fixed plan the agent's knobs reach in the node model, under the
                           fairness floors, against adaptive and the ideal bound
    workload_audit.py      the agent's and the tuner's moves on simulated loops unlike the bench's
                           (pauses, noise, phase shifts, slow disks, very fast or slow steps)
Every command's number flags are read with ``flags.py``'s types (``plain_int``, ``finite_float``).
results/: the JSON, markdown and plots that BENCHMARKS.md cites.
"""
