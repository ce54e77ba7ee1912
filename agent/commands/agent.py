"""`adloader agent`: run the node agent in the foreground (systemd runs this; see agent.daemon)."""
from __future__ import annotations

import sys

from agent.commands import path_arg

NAME = "agent"
FLAGS = ("endpoint", "state_dir", "policy", "tick_s", "loader_cpus", "loader_memory", "max_jobs", "cgroup_mode",
         "metrics_port", "log_level")


def register(sub) -> None:
    """The flags take text: ``agent.config`` parses every value (numbers too, so that '1_0' or '١٠' is
    refused as a config error naming the key, as from the environment; argparse's int() and float()
    took them)."""
    from agent.actuators import MODES as CGROUP_MODES
    from agent.policies import POLICIES

    p = sub.add_parser(NAME, description="Run the A-Dloader node agent in the foreground. Config: defaults <- TOML "
                                   "file <- ADLOADER_<KEY> environment <- these flags. Logs one JSON object "
                                   "per line on stdout. SIGTERM stops (restoring what it changed), SIGHUP "
                                   "reloads the config file.")
    p.add_argument("--config", metavar="PATH", default=None, type=path_arg,
                   help="TOML config file (default /etc/adloader/agent.toml if it exists)")
    p.add_argument("--endpoint", metavar="EP",
                   help="where to bind: ipc:// and an absolute path, or tcp://HOST:PORT (default "
                        "ipc:///run/adloader/agent.sock as root, else $XDG_RUNTIME_DIR/adloader/agent.sock or "
                        "/tmp/adloader-<uid>/agent.sock)")
    p.add_argument("--state-dir", metavar="DIR",
                   help="journal directory (default /var/lib/adloader as root, else <runtime dir>/state)")
    p.add_argument("--policy", metavar="NAME",
                   help=f"allocation policy: {', '.join(sorted(POLICIES))} (default adaptive)")
    p.add_argument("--tick-s", metavar="S", help="controller period in seconds (default 1)")
    p.add_argument("--loader-cpus", metavar="CORES",
                   help="CPU cores for all loaders, or 'auto' (the default: the agent's CPUs less 10%%, grown "
                        "into what the training processes leave)")
    p.add_argument("--loader-memory", metavar="BYTES",
                   help="memory for all loaders' workers: bytes or a size such as 6GiB, 'auto' (node memory or "
                        "the agent's cgroup limit, minus 25%% and at least 2 GiB; the default) or 'off'")
    p.add_argument("--max-jobs", metavar="N",
                   help="jobs the node is sized for (even-static; default 0: the jobs present)")
    p.add_argument("--cgroup-mode", metavar="MODE", choices=CGROUP_MODES,
                   help="|".join(CGROUP_MODES) + " (default auto)")
    p.add_argument("--metrics-port", metavar="N", help="Prometheus port on 127.0.0.1 (default 0 = off)")
    p.add_argument("--log-level", metavar="LEVEL", choices=("debug", "info", "warning", "error"),
                   help="debug|info|warning|error (default info)")
    p.set_defaults(func=run)


def run(args, policy=None) -> int:
    """``policy``: a policy function used instead of ``--policy`` (``evaluation.oracle_agent``)."""
    from agent import config as configmod
    from agent import logs

    cli = {k: getattr(args, k) for k in FLAGS if getattr(args, k, None) is not None}
    try:
        cfg = configmod.load(args.config, cli)
    except configmod.ConfigError as e:
        print(f"adloader agent: {e}", file=sys.stderr)
        return 2
    logs.setup(cfg.log_level)
    from agent.daemon import Agent, CannotStart
    from agent.server import EndpointBusy

    try:
        agent = Agent(cfg, config_path=args.config, cli=cli, policy=policy)
        return agent.run()
    except (EndpointBusy, CannotStart) as e:
        print(f"adloader agent: {e}", file=sys.stderr)
        return 1
    except (OSError, ValueError) as e:
        print(f"adloader agent: cannot start: {e}", file=sys.stderr)
        return 1
