"""``mmroute`` command line: serve, demo, sim-worker, bench."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import Any, Sequence

from mmroute.config import POLICIES, TOKENIZE_MODES, ConfigError, RouterConfig, build_config, load_toml


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("expected a JSON object")
    return value


def _add_serve_args(p: argparse.ArgumentParser) -> None:
    # Defaults are None so that "not given" lets the TOML file (then RouterConfig) decide.
    p.add_argument("--model", help="local model directory or Hugging Face id (tokenizer/config/template files only)")
    p.add_argument("--served-model-name", nargs="+", help="model name(s) clients use (default: --model)")
    p.add_argument("--workers", nargs="+", metavar="SPEC",
                   help="http://HOST:PORT[,kv=tcp://H:P][,replay=tcp://H:P][,name=N][,backend=vllm|sglang]")
    p.add_argument("--host", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="port to listen on (default 8000)")
    p.add_argument("--policy", choices=POLICIES, help="routing policy (default kv)")
    p.add_argument("--block-size", type=int, help="KV block size (default: learned from the first BlockStored)")
    p.add_argument("--config", help="TOML file with the same keys as the flags (flags win)")
    p.add_argument("--log-level", choices=["debug", "info", "warning", "error"], help="default info")
    p.add_argument("--kv-events-bind", metavar="tcp://ADDR:PORT",
                   help="collector mode: bind here, workers' publishers connect (worker = topic = its id)")
    p.add_argument("--tokenize", choices=TOKENIZE_MODES, help="local (default) or remote (the worker's /tokenize)")
    p.add_argument("--verify-tokenization", type=float, metavar="RATE",
                   help="fraction of requests whose local tokens are checked against a worker's /tokenize")
    p.add_argument("--max-model-len", type=int, help="override the model's context length")
    p.add_argument("--chat-template", help="chat template file or inline template (as vLLM --chat-template)")
    p.add_argument("--lora-modules", nargs="+", metavar="NAME", help="LoRA adapter names the workers serve")
    p.add_argument("--temperature", type=float, help="softmax temperature over -cost (0 = always the cheapest)")
    p.add_argument("--w-prefill", type=float, help="weight of prefill blocks in the cost")
    p.add_argument("--w-decode", type=float, help="weight of active decode blocks in the cost")
    p.add_argument("--speculative-ttl", type=float, help="seconds a routed prefix counts as cached before its events")
    p.add_argument("--max-retries", type=int, help="retries on another worker before the first byte (default 2)")
    p.add_argument("--health-interval", type=float, help="seconds between worker health checks")
    p.add_argument("--media-allow-hosts", nargs="+", metavar="HOST_OR_CIDR",
                   help="image hosts allowed despite the private-address guard")
    p.add_argument("--media-max-bytes", type=int, help="largest image payload accepted")
    p.add_argument("--mm-processor-kwargs", type=_json_object, metavar="JSON",
                   help="the workers' --mm-processor-kwargs (e.g. '{\"max_pixels\": 1003520}')")
    p.add_argument("--allow-page-size-1", action="store_true", default=None,
                   help="accept SGLang workers with page size 1 (one KV event per token)")


def _config_from_args(args: argparse.Namespace) -> RouterConfig:
    flags = {k: v for k, v in vars(args).items() if k not in ("command", "config", "func")}
    file_values = load_toml(args.config) if args.config else {}
    cfg = build_config(file_values, flags)
    cfg.validate()
    return cfg


def _setup_logging(level: str) -> None:
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def cmd_serve(args: argparse.Namespace) -> int:
    from mmroute.api.app import run

    cfg = _config_from_args(args)
    _setup_logging(cfg.log_level)
    run(cfg)
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from mmroute.demo import run_demo

    _setup_logging(args.log_level or "info")
    return run_demo(args)


def cmd_sim_worker(args: argparse.Namespace) -> int:
    from mmroute.sim import run_sim_worker

    _setup_logging(getattr(args, "log_level", None) or "info")
    return run_sim_worker(args) or 0


def cmd_bench(args: argparse.Namespace) -> int:
    from mmroute.bench.overhead import run_bench

    return run_bench(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mmroute", description="KV-cache-aware router for vLLM and SGLang fleets")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("serve", help="run the router in front of workers")
    _add_serve_args(p)
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("demo", help="2 simulated workers + the router on loopback, offline")
    p.add_argument("--port", type=int, default=8000, help="router port (default 8000; 0 = any free port)")
    p.add_argument("--workers", type=int, default=2, help="number of simulated workers (default 2)")
    p.add_argument("--log-level", default="info")
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("sim-worker", help="a simulated vLLM or SGLang worker (GPU-free)")
    from mmroute.sim import add_arguments

    add_arguments(p)
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.set_defaults(func=cmd_sim_worker)

    p = sub.add_parser("bench", help="routing-overhead benchmark (see docs/performance.md)")
    from mmroute.bench.overhead import add_arguments as add_bench_arguments

    add_bench_arguments(p)
    p.set_defaults(func=cmd_bench)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args: Any = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except ConfigError as exc:
        print(f"mmroute: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
