"""`python -m copier_mt5_bridge --config bridge.toml`: runs the bridge until interrupted.

Prints `copier-mt5-bridge listening on HOST:PORT` on standard output once it accepts
connections (with `listen = "127.0.0.1:0"` the port is the one the system chose), and logs to
standard error.

Imports stay inside `main`: each worker process is started with the "spawn" method (the only
one Windows has), which imports this module again in the worker, and a worker needs neither the
server nor asyncio.
"""

from __future__ import annotations

import sys


def main(argv=None) -> int:
    import argparse
    import asyncio
    import logging

    from .config import ConfigError, load
    from .server import run

    parser = argparse.ArgumentParser(prog="copier-mt5-bridge",
                                     description="copier-node's bridge for MetaTrader 5")
    parser.add_argument("--config", required=True, help="the bridge's TOML configuration file")
    parser.add_argument("--log-level", default="INFO",
                        choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s %(message)s")
    try:
        config = load(args.config)
    except ConfigError as e:
        print(f"copier-mt5-bridge: {e}", file=sys.stderr)
        return 2
    try:
        asyncio.run(run(config, args.log_level))
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
