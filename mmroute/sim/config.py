"""``mmroute sim-worker`` flags and the resolved simulator configuration."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field, fields
from pathlib import Path

from mmroute.sim.vllm_hash import HASH_ALGOS

BACKENDS = ("vllm", "sglang")
WIRE_FORMATS = ("map", "array")
DEMO_MODEL = str(Path(__file__).resolve().parent.parent / "demo_model")
# The release each wire format emulates (reported by /version and /server_info).
VLLM_VERSIONS = {"map": "0.33.0", "array": "0.23.0"}
DEFAULT_SGLANG_VERSION = "0.5.23"


class SimConfigError(ValueError):
    """A flag combination the simulator cannot run with."""


@dataclass(frozen=True)
class LoraModule:
    name: str
    path: str
    int_id: int


@dataclass(frozen=True)
class SimConfig:
    model: str = DEMO_MODEL
    served_model_name: str | None = None
    host: str = "127.0.0.1"
    port: int = 0
    backend: str = "vllm"
    sglang_version: str = DEFAULT_SGLANG_VERSION
    ignore_mm_hashes: bool = False  # emulate a build that drops /generate mm_hashes (before 0.5.18)
    block_size: int = 16
    num_blocks: int = 4096
    kv_endpoint: str = "tcp://127.0.0.1:0"
    kv_bind: bool = False  # bind the KV endpoint even without "*" (a fixed loopback port)
    replay_endpoint: str | None = "tcp://127.0.0.1:0"
    topic: str = ""
    wire_format: str = "map"
    int_hashes: bool = True
    hash_algo: str = "sha256"
    prefill_ms_per_token: float = 0.0
    decode_ms_per_token: float = 0.0
    max_concurrency: int = 64
    max_model_len: int | None = None
    default_max_tokens: int = 16
    lora_modules: tuple[LoraModule, ...] = field(default_factory=tuple)
    buffer_steps: int = 10_000

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model

    @property
    def engine_version(self) -> str:
        return self.sglang_version if self.backend == "sglang" else VLLM_VERSIONS[self.wire_format]

    @property
    def flavor(self) -> str:
        return f"{self.backend}-{self.wire_format}"

    @property
    def replay_layout(self) -> str:
        # vLLM <= 0.25 replies without a topic frame; vLLM >= 0.26 and SGLang with one.
        return "plain" if (self.backend == "vllm" and self.wire_format == "array") else "topic"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``sim-worker`` flags (the CLI wires them into ``mmroute sim-worker``)."""
    g = parser.add_argument_group("simulated engine")
    g.add_argument("--model", default=DEMO_MODEL, help="model directory or HF id (tokenizer, template, processor); "
                   "default: the embedded demo model (Qwen2.5-VL tokenizer)")
    g.add_argument("--served-model-name", default=None, help="name clients use (default: --model)")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=0, help="HTTP port; 0 = ephemeral (see the SIM_READY line)")
    g.add_argument("--backend", choices=BACKENDS, default="vllm", help="engine to emulate")
    g.add_argument("--sglang-ignore-mm-hashes", dest="ignore_mm_hashes", action="store_true",
                   help="emulate an SGLang build that ignores /generate mm_hashes (releases before 0.5.18 do)")
    g.add_argument("--sglang-version", default=DEFAULT_SGLANG_VERSION,
                   help="SGLang release to emulate (>= 0.5.23: wide pad values, else legacy)")
    g.add_argument("--block-size", type=int, default=16, help="KV block size (SGLang: page size)")
    g.add_argument("--num-blocks", type=int, default=4096,
                   help="KV cache capacity in blocks (vLLM: including the null block; SGLang: pages)")
    g.add_argument("--kv-endpoint", default="tcp://127.0.0.1:0",
                   help="KV-event PUB endpoint: binds for '*', '::', ipc://, inproc:// or port 0, else connects")
    g.add_argument("--replay-endpoint", default="tcp://127.0.0.1:0",
                   help="replay ROUTER endpoint (always binds); 'none' disables replay")
    g.add_argument("--kv-bind", action="store_true",
                   help="bind --kv-endpoint even without '*' (e.g. a fixed 127.0.0.1 port across restarts)")
    g.add_argument("--topic", default="", help="KV-event topic")
    g.add_argument("--wire-format", choices=WIRE_FORMATS, default="map",
                   help="event encoding: map (vLLM 0.24-0.33 / SGLang >= 0.5.20) or array (vLLM 0.23: positional, "
                   "replay without topic; SGLang <= 0.5.19)")
    hashes = g.add_mutually_exclusive_group()
    hashes.add_argument("--int-hashes", dest="int_hashes", action="store_true", default=True,
                        help="vLLM: publish hashes as low-64-bit ints (default, VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1)")
    hashes.add_argument("--bytes-hashes", dest="int_hashes", action="store_false",
                        help="vLLM: publish raw 32-byte digests")
    g.add_argument("--prefix-caching-hash-algo", dest="hash_algo", choices=HASH_ALGOS, default="sha256",
                   help="vLLM block hash: sha256 (pickle, vLLM's default) or sha256_cbor")
    g.add_argument("--prefill-ms-per-token", type=float, default=0.0, help="latency per uncached prompt token")
    g.add_argument("--decode-ms-per-token", type=float, default=0.0, help="latency per output token")
    g.add_argument("--max-concurrency", type=int, default=64, help="running requests; more wait in the queue")
    g.add_argument("--max-model-len", type=int, default=None, help="context limit (default: from the model files)")
    g.add_argument("--default-max-tokens", type=int, default=16, help="output tokens when the request sets none")
    g.add_argument("--lora-modules", nargs="*", default=[], metavar="NAME=PATH",
                   help="LoRA adapters served under their own model name (vLLM)")


def config_from_args(args: argparse.Namespace) -> SimConfig:
    loras = []
    for i, spec in enumerate(getattr(args, "lora_modules", None) or [], start=1):
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise SimConfigError(f"--lora-modules expects NAME=PATH, got {spec!r}")
        loras.append(LoraModule(name, path, i))
    replay = args.replay_endpoint
    if replay is not None and replay.lower() in ("", "none", "off"):
        replay = None
    # Every flag is named after its SimConfig field; a Namespace without one keeps the default.
    flags = {f.name: getattr(args, f.name) for f in fields(SimConfig) if hasattr(args, f.name)}
    cfg = SimConfig(**{**flags, "replay_endpoint": replay, "lora_modules": tuple(loras)})
    validate(cfg)
    return cfg


def validate(cfg: SimConfig) -> None:
    if cfg.backend not in BACKENDS:
        raise SimConfigError(f"--backend must be one of {', '.join(BACKENDS)}")
    if cfg.wire_format not in WIRE_FORMATS:
        raise SimConfigError(f"--wire-format must be one of {', '.join(WIRE_FORMATS)}")
    if cfg.block_size <= 0:
        raise SimConfigError("--block-size must be positive")
    if cfg.num_blocks < 2:
        raise SimConfigError("--num-blocks must be at least 2")
    if cfg.max_concurrency <= 0:
        raise SimConfigError("--max-concurrency must be positive")
    if cfg.prefill_ms_per_token < 0 or cfg.decode_ms_per_token < 0:
        raise SimConfigError("latencies must not be negative")
    if cfg.backend == "sglang" and not cfg.int_hashes:
        raise SimConfigError("--bytes-hashes is a vLLM option (SGLang always publishes int64 hashes)")
    if cfg.backend == "sglang" and cfg.lora_modules:
        raise SimConfigError("--lora-modules is only emulated for --backend vllm")
