"""Router configuration: worker specs, flags and the TOML file.

The lowest layer: every other module may import this one, it imports nothing of
mmroute. Flags win over the TOML file, which wins over the defaults below.
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised only on 3.10
    import tomli as tomllib

# vLLM's and SGLang's default KV-event publisher port (ENGINES.md §1.1, §3.1).
DEFAULT_KV_PORT = 5557

POLICIES = ("kv", "round-robin", "least-loaded", "random")
BACKENDS = ("auto", "vllm", "sglang")
TOKENIZE_MODES = ("local", "remote")


class ConfigError(ValueError):
    """A configuration the router cannot start with; the message says what to fix."""


@dataclass(frozen=True)
class WorkerSpec:
    """One worker as given on the command line:
    ``http://HOST:PORT[,kv=tcp://H:P][,replay=tcp://H:P][,name=N][,backend=vllm|sglang]``.
    """

    url: str
    kv_endpoint: str | None = None  # None: default tcp://HOST:5557, or discovered (SGLang)
    replay_endpoint: str | None = None
    name: str | None = None
    backend: str = "auto"
    kv_explicit: bool = False  # kv= given by the operator (discovery must not override)

    @property
    def id(self) -> str:
        return self.name or self.url

    @property
    def host(self) -> str:
        return urlsplit(self.url).hostname or "127.0.0.1"

    @classmethod
    def parse(cls, spec: str) -> "WorkerSpec":
        parts = [p.strip() for p in spec.split(",") if p.strip()]
        if not parts:
            raise ConfigError("empty worker spec")
        url = parts[0].rstrip("/")
        u = urlsplit(url)
        if u.scheme not in ("http", "https") or not u.hostname:
            raise ConfigError(f"worker spec {spec!r}: expected http://HOST:PORT first")
        opts: dict[str, str] = {}
        for p in parts[1:]:
            if "=" not in p:
                raise ConfigError(f"worker spec {spec!r}: option {p!r} is not key=value")
            k, v = p.split("=", 1)
            k = k.strip()
            if k not in ("kv", "replay", "name", "backend"):
                raise ConfigError(f"worker spec {spec!r}: unknown option {k!r} (kv, replay, name, backend)")
            opts[k] = v.strip()
        for k in ("kv", "replay"):
            if k in opts and not opts[k].startswith(("tcp://", "ipc://", "inproc://")):
                raise ConfigError(f"worker spec {spec!r}: {k}= must be a ZMQ endpoint like tcp://HOST:PORT")
        backend = opts.get("backend", "auto")
        if backend not in BACKENDS:
            raise ConfigError(f"worker spec {spec!r}: backend must be one of {', '.join(BACKENDS)}")
        kv = opts.get("kv")
        return cls(
            url=url,
            kv_endpoint=kv if kv is not None else f"tcp://{u.hostname}:{DEFAULT_KV_PORT}",
            replay_endpoint=opts.get("replay"),
            name=opts.get("name"),
            backend=backend,
            kv_explicit=kv is not None,
        )


@dataclass
class RouterConfig:
    model: str = ""
    served_model_name: list[str] = field(default_factory=list)
    workers: list[WorkerSpec] = field(default_factory=list)
    host: str = "127.0.0.1"
    port: int = 8000
    policy: str = "kv"
    block_size: int | None = None  # None: learned from the first BlockStored
    tokenize: str = "local"
    verify_tokenization: float = 0.0
    kv_events_bind: str | None = None  # collector mode: publishers connect to us
    log_level: str = "info"
    max_model_len: int | None = None  # None: from the model's config
    chat_template: str | None = None  # path or inline template (vLLM --chat-template)
    # Scoring (DESIGN.md "Load and scoring").
    w_prefill: float = 1.0
    w_decode: float = 0.1
    temperature: float = 0.0
    speculative_ttl: float = 2.0
    booking_ttl: float = 600.0
    # Proxy.
    max_retries: int = 2
    connect_timeout: float = 5.0
    request_timeout: float = 600.0
    health_interval: float = 2.0
    # Media (issue #3).
    media_fetch_timeout: float = 10.0
    media_max_bytes: int = 32 * 1024 * 1024
    media_max_pixels: int = 178_956_970  # PIL's decompression-bomb threshold (x2 of its warning)
    media_allow_hosts: list[str] = field(default_factory=list)  # CIDRs/hosts allowed despite SSRF guard
    allow_page_size_1: bool = False
    lora_modules: list[str] = field(default_factory=list)  # adapter names served by the workers
    # The workers' --mm-processor-kwargs (min_pixels, max_pixels, num_crops): image token counts depend on them.
    mm_processor_kwargs: dict[str, Any] = field(default_factory=dict)

    def validate(self) -> None:
        if not self.model:
            raise ConfigError("--model is required")
        if not self.workers:
            raise ConfigError("at least one worker is required (--workers http://HOST:PORT ...)")
        if self.policy not in POLICIES:
            raise ConfigError(f"--policy must be one of {', '.join(POLICIES)}")
        if self.tokenize not in TOKENIZE_MODES:
            raise ConfigError(f"--tokenize must be one of {', '.join(TOKENIZE_MODES)}")
        if not 0.0 <= self.verify_tokenization <= 1.0:
            raise ConfigError("--verify-tokenization must be a fraction in [0, 1]")
        if self.block_size is not None and self.block_size <= 0:
            raise ConfigError("--block-size must be positive")
        ids = [w.id for w in self.workers]
        dupes = {i for i in ids if ids.count(i) > 1}
        if dupes:
            raise ConfigError(f"duplicate worker ids: {', '.join(sorted(dupes))} (give each a name=)")

    @property
    def model_names(self) -> list[str]:
        return self.served_model_name or [self.model]


_FIELD_NAMES = {f.name for f in dataclasses.fields(RouterConfig)}


def load_toml(path: str) -> dict[str, Any]:
    """Read a TOML config; keys are the long flag names with ``-`` or ``_``."""
    try:
        with open(path, "rb") as fh:
            raw = tomllib.load(fh)
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"cannot read config {path}: {exc}") from exc
    out: dict[str, Any] = {}
    for key, value in raw.items():
        name = key.replace("-", "_")
        if name not in _FIELD_NAMES:
            raise ConfigError(f"config {path}: unknown key {key!r}")
        out[name] = value
    return out


_DEFAULTS = RouterConfig()


def _check_type(name: str, value: Any) -> None:
    """TOML values must have the type of the flag they stand for: fail at start-up with
    the key's name, not later with a traceback."""
    default = getattr(_DEFAULTS, name)
    if value is None or name in ("workers", "served_model_name"):
        return
    want: tuple[type, ...]
    if isinstance(default, bool):
        want = (bool,)
    elif isinstance(default, float):
        want = (int, float)
    elif isinstance(default, int) or name in ("block_size", "max_model_len"):
        want = (int,)
    elif isinstance(default, list):
        want = (list,)
    elif isinstance(default, dict):
        want = (dict,)
    else:
        want = (str,)
    if not isinstance(value, want) or (isinstance(value, bool) and bool not in want):
        raise ConfigError(f"config key {name!r} must be {' or '.join(t.__name__ for t in want)}, not {value!r}")
    if isinstance(value, list) and not all(isinstance(v, str) for v in value):
        raise ConfigError(f"config key {name!r} must be a list of strings")


def build_config(file_values: dict[str, Any], flag_values: dict[str, Any]) -> RouterConfig:
    """Merge defaults < TOML file < flags (flags given as None are 'not set')."""
    merged: dict[str, Any] = dict(file_values)
    merged.update({k: v for k, v in flag_values.items() if v is not None})
    workers = merged.pop("workers", []) or []
    if isinstance(workers, str):
        workers = [workers]
    if not isinstance(workers, list) or not all(isinstance(w, (str, WorkerSpec)) for w in workers):
        raise ConfigError("'workers' must be a list of worker specs (strings)")
    served = merged.pop("served_model_name", []) or []
    if isinstance(served, str):
        served = [served]
    for name, value in merged.items():
        _check_type(name, value)
    cfg = RouterConfig(**merged)
    cfg.workers = [w if isinstance(w, WorkerSpec) else WorkerSpec.parse(w) for w in workers]
    cfg.served_model_name = list(served)
    return cfg
