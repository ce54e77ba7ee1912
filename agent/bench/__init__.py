"""``adloader bench`` / ``adloader demo``: co-located real training jobs under each policy, side by side.

    catalog.py      job kinds (catalog.toml) and their calibration on this machine
    jobproc.py      one job process (adloader.DataLoader over generated JPEGs, emulated or CUDA step)
    harness.py      scenarios, phases (agent + jobs + events), progress files -> records -> metrics
    oracle.py       best static allocation from measured curves (exact knapsack)
    oracle_agent.py the real agent with the oracle's plan as its policy
    metrics.py      metric formulas (pure)
    report.py       medians over repeats, ratios, goals, markdown/JSON, the progress display
    plots.py        PNG plots (matplotlib, Agg)
    setup.py        what bench and demo share: node facts, calibration, the run itself
"""
