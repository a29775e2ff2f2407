"""``python -m mmroute.sim [flags]``: the simulated worker without the mmroute CLI."""

from __future__ import annotations

import argparse
import sys

from mmroute.sim import add_arguments, run_sim_worker


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mmroute sim-worker", description="Simulated vLLM/SGLang worker")
    add_arguments(parser)
    return run_sim_worker(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
