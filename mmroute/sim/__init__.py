"""The simulated engine (``mmroute sim-worker``): a GPU-free stand-in for a vLLM or
SGLang worker with the engines' own cache semantics, block hashes and KV-event wire
format. It never uses the router's ``routing`` keys or ``kv`` decoder: the two only
meet on the wire.

Entry points: ``add_arguments(parser)`` (the CLI flags) and ``run_sim_worker(args)``.
"""

from __future__ import annotations

import argparse
import asyncio
import sys

from mmroute.sim.config import SimConfig, SimConfigError, add_arguments, config_from_args

__all__ = ["SimConfig", "SimConfigError", "add_arguments", "config_from_args", "run_sim_worker"]


def run_sim_worker(args: argparse.Namespace) -> int:
    """Run the simulated worker until SIGINT/SIGTERM; 0 on a clean stop, 2 on bad flags."""
    from mmroute.sim.server import serve

    try:
        config = config_from_args(args)
    except SimConfigError as exc:
        print(f"sim-worker: {exc}", file=sys.stderr)
        return 2
    try:
        import uvloop  # type: ignore[import-not-found]

        uvloop.install()
    except ImportError:  # pragma: no cover - optional
        pass
    try:
        asyncio.run(serve(config))
    except KeyboardInterrupt:  # pragma: no cover - signal raced the handler
        pass
    except (OSError, RuntimeError, ValueError) as exc:
        print(f"sim-worker: {exc}", file=sys.stderr)
        return 1
    return 0
