"""`adloader status`: each job's ranks, workers, CPU share, data wait, GPU idle, samples/s, predicted
max useful workers and the reason for its allocation (``--json``: the document in agent.status)."""
from __future__ import annotations

import json
import sys

NAME = "status"


def register(sub) -> None:
    p = sub.add_parser(NAME, description="Ask the node agent for its status. --json prints the status document "
                                   "(fields documented in agent/status.py).")
    p.add_argument("--endpoint", metavar="EP", default=None,
                   help="agent endpoint (default: ADLOADER_ENDPOINT, else the endpoint key of "
                        "/etc/adloader/agent.toml, else the system or your user's socket)")
    p.add_argument("--json", action="store_true", help="print the status document as JSON")
    from agent.rpc import timeout_arg

    p.add_argument("--timeout-s", type=timeout_arg, default=3.0, metavar="S",
                   help="how long to wait for the agent, seconds (default 3)")
    p.set_defaults(func=run)


def run(args) -> int:
    from agent import config, status

    bad_endpoint = config.endpoint_argument_problem(args.endpoint)
    if bad_endpoint:
        print(f"adloader status: {bad_endpoint}", file=sys.stderr)
        return 2
    endpoint, note = config.client_endpoint(args.endpoint)
    try:
        doc = status.query(endpoint, timeout_s=args.timeout_s)
    except RuntimeError as e:
        if config.endpoint_from_environment(args.endpoint):
            note = config.ENDPOINT_FROM_ENV_NOTE
        print(f"adloader status: {e}" + (f" ({note})" if note else ""), file=sys.stderr)
        return 1
    if note:   # on stderr: a broken agent config is worth a word when the agent answered too (stdout is for scripts)
        print(f"adloader status: {note}", file=sys.stderr)
    if args.json:
        json.dump(doc, sys.stdout, indent=2, sort_keys=True)
        sys.stdout.write("\n")
    else:
        print(status.render_table(doc))
    return 0
