"""Deployment files: bin/ launchers, docker/Dockerfile, docker/compose.yaml.

The launchers run for real with stand-ins for the engines: a tiny ``vllm`` (or
``python -m sglang.launch_server``) executable that records the arguments it was
given and then becomes ``mmroute sim-worker`` with the KV endpoints taken from the
``--kv-events-config`` JSON. The router is then started from the exact ``mmroute serve``
line the launcher printed and must index KV events from every launched worker: proof
that the flags, ports and worker specs agree end to end.

The compose file is checked structurally on the facts the fleet relies on (profiles,
service names in the worker specs, ports, KV configs, health checks), with mmroute's
own parsers for every mmroute command. PyYAML comes with huggingface_hub, a runtime
dependency.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import random
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import pytest
import yaml

from mmroute.api.app import start_background
from mmroute.api.context import AppContext
from mmroute.cli import build_parser
from mmroute.config import RouterConfig, build_config
from mmroute.sim.config import config_from_args

ROOT = Path(__file__).resolve().parent.parent
VLLM_SCRIPT = ROOT / "bin" / "launch-vllm-workers.sh"
SGLANG_SCRIPT = ROOT / "bin" / "launch-sglang-workers.sh"
WORKERS_LIB = ROOT / "bin" / "lib" / "workers.sh"  # sourced by both launchers
DOCKERFILE = ROOT / "docker" / "Dockerfile"
COMPOSE = ROOT / "docker" / "compose.yaml"
DEMO_MODEL = str(ROOT / "mmroute" / "demo_model")
WAIT = 120.0  # generous: readiness is awaited on explicit conditions, never slept for

# ---------------------------------------------------------------- engine stand-ins

_STUB = r'''#!{python}
"""Stand-in for `{kind}`: record argv, then hang, exit or become a sim worker."""
import json, os, signal, sys
argv = sys.argv[1:]
if "{kind}" == "sglang":
    assert argv[:2] == ["-m", "sglang.launch_server"], argv
def opt(name, default=None):
    return argv[argv.index(name) + 1] if name in argv else default
port = opt("--port")
with open(os.path.join(os.environ["STUB_RECORD_DIR"], "argv-" + port + ".json"), "w") as fh:
    json.dump({{"argv": argv, "pid": os.getpid(), "pgid": os.getpgid(0),
               "cuda": os.environ.get("CUDA_VISIBLE_DEVICES")}}, fh)
if port in os.environ.get("STUB_EXIT_PORTS", "").split(","):
    sys.exit(3)
if port in os.environ.get("STUB_HANG_PORTS", "").split(","):
    while True:
        signal.pause()
kv = json.loads(opt("--kv-events-config"))
cmd = [sys.executable, "-m", "mmroute", "sim-worker", "--host", opt("--host"), "--port", port,
       "--kv-endpoint", kv["endpoint"], "--replay-endpoint", kv["replay_endpoint"], "--topic", kv["topic"],
       "--log-level", "warning"]
if opt("--served-model-name"):
    cmd += ["--served-model-name", opt("--served-model-name")]
if "{kind}" == "sglang":
    cmd += ["--backend", "sglang", "--block-size", opt("--page-size")]
os.execv(sys.executable, cmd)
'''


def _stub(tmp_path: Path, kind: str) -> Path:
    path = tmp_path / f"{kind}-stub"
    path.write_text(_STUB.format(python=sys.executable, kind=kind))
    path.chmod(0o755)
    return path


def _launch_env(tmp_path: Path, kind: str) -> tuple[int, int, Path, dict[str, str]]:
    """(HTTP base port, KV base port, record dir, environment) of a launcher run with the
    ``kind`` stand-in: 2 HTTP and 4 KV ports free, logs and records under ``tmp_path``."""
    http, kvb = _port_block(2), _port_block(4)
    rec = tmp_path / "rec"
    rec.mkdir()
    exe = "VLLM" if kind == "vllm" else "SGLANG_PYTHON"
    env = {exe: str(_stub(tmp_path, kind)), "BASE_PORT": str(http), "KV_BASE": str(kvb),
           "LOG_DIR": str(tmp_path / "logs"), "TIMEOUT": str(int(WAIT)), "STUB_RECORD_DIR": str(rec)}
    return http, kvb, rec, env


def _port_block(n: int) -> int:
    """A base port with ``n`` consecutive ports free on every interface."""
    for _ in range(200):
        base = random.randrange(20000, 60000 - n)
        socks = []
        try:
            for p in range(base, base + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("0.0.0.0", p))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no block of free ports")


class Launch:
    """A launcher script run in the background; stdout/stderr collected line by line."""

    def __init__(self, script: Path, args: list[str], env: dict[str, str]):
        self.proc = subprocess.Popen(["bash", str(script), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, env={**os.environ, **env}, cwd=ROOT)
        self.out: queue.Queue[str] = queue.Queue()
        self.err_lines: list[str] = []
        self._threads = [threading.Thread(target=self._pump, args=(self.proc.stdout, self.out.put), daemon=True),
                         threading.Thread(target=self._pump, args=(self.proc.stderr, self.err_lines.append), daemon=True)]
        for t in self._threads:
            t.start()

    @staticmethod
    def _pump(stream: Any, sink: Any) -> None:
        for line in stream:
            sink(line.rstrip("\n"))

    @property
    def stderr(self) -> str:
        return "\n".join(self.err_lines)

    def worker_pids(self) -> list[int]:
        """The pids the launcher reported for the workers it started."""
        return [int(m.group(1)) for m in re.finditer(r"^worker \d+: pid (\d+),", self.stderr, re.M)]

    def serve_line(self) -> str:
        deadline = time.monotonic() + WAIT
        while time.monotonic() < deadline:
            try:
                line = self.out.get(timeout=1.0)
            except queue.Empty:
                if self.proc.poll() is not None:
                    break
                continue
            if line.startswith("mmroute serve "):
                return line
        raise AssertionError(f"no serve line (exit {self.proc.poll()}):\n{self.stderr}")

    def wait(self, timeout: float = WAIT) -> int:
        rc = self.proc.wait(timeout)
        for t in self._threads:  # everything written is read once the pipes hit EOF
            t.join(timeout)
        return rc

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def _records(rec_dir: Path) -> dict[int, dict[str, Any]]:
    out = {}
    for f in rec_dir.glob("argv-*.json"):
        out[int(f.stem.split("-")[1])] = json.loads(f.read_text())
    return out


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie (exited, not yet reaped by its parent) counts as gone.
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _wait_gone(pids: list[int], timeout: float = WAIT) -> list[int]:
    deadline = time.monotonic() + timeout
    left = [p for p in pids if _alive(p)]
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = [p for p in left if _alive(p)]
    return left


def _kill_leftovers(launch: "Launch", rec_dir: Path) -> None:
    """Safety net: stop any stand-in this test started that is still running (by pid)."""
    for pid in {*launch.worker_pids(), *(r["pid"] for r in _records(rec_dir).values())}:
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)


def _serve_config(line: str) -> RouterConfig:
    argv = shlex.split(line)
    assert argv[:2] == ["mmroute", "serve"], line
    args = build_parser().parse_args(argv[1:])
    flags = {k: v for k, v in vars(args).items() if k not in ("command", "config", "func")}
    flags.update(port=0, host="127.0.0.1", health_interval=0.5)
    cfg = build_config({}, flags)
    cfg.validate()
    return cfg


async def _route_through(ctx: AppContext, port: int, reset_path: str) -> None:
    """With the router up: wait until it has applied a KV message of every worker, send
    one conversation twice, and check the repeat hit the cache of the worker that holds it."""
    cfg = ctx.config
    url = f"http://127.0.0.1:{port}"
    async with aiohttp.ClientSession() as http:
        await ctx.registry.wait_healthy(len(cfg.workers), WAIT)
        for w in ctx.registry.workers.values():
            deadline = time.monotonic() + WAIT
            while True:
                subs = [s for (wid, _), s in ctx.subscribers.items() if wid == w.id]
                if subs and subs[0].messages_applied > 0:
                    break
                assert time.monotonic() < deadline, f"router never saw a KV event from {w.id}"
                async with http.post(w.url + reset_path) as r:  # publishes AllBlocksCleared
                    assert r.status == 200
                if subs:
                    await subs[0].wait_for(lambda s: s.messages_applied > 0, 0.1)
                else:
                    await ctx.registry.check_now(w.id)
        body = {"model": cfg.model_names[0], "max_tokens": 2,
                "messages": [{"role": "system", "content": "You route requests by KV-cache overlap. " * 8},
                             {"role": "user", "content": "Which worker holds this prefix?"}]}
        served = []
        for _ in range(2):
            async with http.post(url + "/v1/chat/completions", json=body) as r:
                data = await r.json()
                assert r.status == 200, data
                served.append((r.headers["x-mmroute-worker"], data["usage"]))
        (w1, _u1), (w2, u2) = served
        assert w1 == w2
        assert (u2.get("prompt_tokens_details") or {}).get("cached_tokens", 0) > 0, u2
        # The events of the request reached the index through the printed kv endpoint.
        sub = [s for (wid, _), s in ctx.subscribers.items() if wid == w1][0]
        assert await sub.wait_for(lambda _s: ctx.index.block_count(w1) > 0, WAIT), f"no blocks indexed for {w1}"


# ---------------------------------------------------------------- scripts: syntax and lint


@pytest.mark.parametrize("script", [VLLM_SCRIPT, SGLANG_SCRIPT], ids=lambda p: p.name)
def test_script_syntax(script: Path) -> None:
    r = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert os.access(script, os.X_OK), f"{script} is not executable"
    assert "set -euo pipefail" in script.read_text()


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck not installed (apt-get install shellcheck)")
@pytest.mark.parametrize("script", [VLLM_SCRIPT, SGLANG_SCRIPT, WORKERS_LIB], ids=lambda p: p.name)
def test_script_shellcheck(script: Path) -> None:
    r = subprocess.run(["shellcheck", str(script)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize("script", [VLLM_SCRIPT, SGLANG_SCRIPT], ids=lambda p: p.name)
def test_script_usage_errors(script: Path, tmp_path: Path) -> None:
    r = subprocess.run(["bash", str(script)], capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 2 and "N MODEL" in r.stderr
    r = subprocess.run(["bash", str(script), "two", "m"], capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 2 and "N must be a positive integer" in r.stderr
    env = {**os.environ, "VLLM": str(tmp_path / "nope"), "SGLANG_PYTHON": str(tmp_path / "nope")}
    r = subprocess.run(["bash", str(script), "1", "m"], capture_output=True, text=True, cwd=tmp_path, env=env)
    assert r.returncode == 2 and "nope' not found" in r.stderr
    r = subprocess.run(["bash", str(script), "1", "m"], capture_output=True, text=True, cwd=tmp_path,
                       env={**os.environ, "BASE_PORT": "80a"})
    assert r.returncode == 2 and "BASE_PORT must be" in r.stderr


# ---------------------------------------------------------------- vLLM launcher, for real


async def test_vllm_launcher_end_to_end(tmp_path: Path) -> None:
    http, kvb, rec, env = _launch_env(tmp_path, "vllm")
    env.update(GPU_OFFSET="2", PYTHONPATH=str(ROOT))
    launch = Launch(VLLM_SCRIPT, ["2", DEMO_MODEL, "--served-model-name", "demo", "--max-num-seqs", "8"], env)
    runner = None
    try:
        line = launch.serve_line()
        cfg = _serve_config(line)
        assert cfg.model == DEMO_MODEL and cfg.model_names == ["demo"]
        assert [w.id for w in cfg.workers] == ["vllm-0", "vllm-1"]
        for i, w in enumerate(cfg.workers):
            assert w.url == f"http://127.0.0.1:{http + i}"
            assert w.kv_endpoint == f"tcp://127.0.0.1:{kvb + 2 * i}" and w.kv_explicit
            assert w.replay_endpoint == f"tcp://127.0.0.1:{kvb + 2 * i + 1}"

        records = _records(rec)
        assert sorted(records) == [http, http + 1]
        for i in range(2):
            r = records[http + i]
            argv = r["argv"]
            assert argv[:2] == ["serve", DEMO_MODEL]
            assert "--enable-prefix-caching" in argv and "--enable-prompt-tokens-details" in argv
            assert argv[argv.index("--port") + 1] == str(http + i)
            assert argv[argv.index("--host") + 1] == "0.0.0.0"
            kv = json.loads(argv[argv.index("--kv-events-config") + 1])
            assert kv == {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{kvb + 2 * i}",
                          "replay_endpoint": f"tcp://*:{kvb + 2 * i + 1}", "topic": "kv-events"}
            assert argv[-4:] == ["--served-model-name", "demo", "--max-num-seqs", "8"]  # extra args last
            assert r["cuda"] == str(2 + i)
            assert r["pgid"] == r["pid"], "each worker must lead its own process group"

        ctx = AppContext(cfg)
        runner, port = await start_background(cfg, ctx)
        await _route_through(ctx, port, "/reset_prefix_cache")
        for i, w in enumerate(cfg.workers):
            assert ctx.registry.get(w.id).backend == "vllm"

        launch.proc.send_signal(signal.SIGINT)  # Ctrl-C stops every worker
        assert launch.wait() == 130
        assert sorted(launch.worker_pids()) == sorted(r["pid"] for r in records.values())
        assert _wait_gone(launch.worker_pids()) == []
        assert "stopping 2 vLLM worker(s)" in launch.stderr
    finally:
        if runner is not None:
            await runner.cleanup()
        launch.stop()
        _kill_leftovers(launch, rec)


def test_vllm_launcher_names_the_worker_that_exits(tmp_path: Path) -> None:
    http, kvb, rec, env = _launch_env(tmp_path, "vllm")
    env.update(STUB_HANG_PORTS=str(http), STUB_EXIT_PORTS=str(http + 1))
    launch = Launch(VLLM_SCRIPT, ["2", "m"], env)
    try:
        assert launch.wait() == 1
        assert f"worker 1 (port {http + 1}) exited with status 3 before becoming healthy" in launch.stderr
        assert str(tmp_path / "logs" / "worker-1.log") in launch.stderr
        assert launch.out.empty(), "no serve line on failure"
        pids = launch.worker_pids()
        assert len(pids) == 2 and _wait_gone(pids) == []  # the still-starting worker 0 was stopped
    finally:
        launch.stop()
        _kill_leftovers(launch, rec)


def test_vllm_launcher_times_out_naming_workers(tmp_path: Path) -> None:
    http, kvb, rec, env = _launch_env(tmp_path, "vllm")
    env.update(TIMEOUT="1", STUB_HANG_PORTS=f"{http},{http + 1}")
    launch = Launch(VLLM_SCRIPT, ["2", "m"], env)
    try:
        assert launch.wait() == 1
        for i in range(2):
            assert f"worker {i} (http://127.0.0.1:{http + i}/health, log " in launch.stderr
        assert "not healthy after 1s" in launch.stderr
        pids = launch.worker_pids()
        assert len(pids) == 2 and _wait_gone(pids) == []
    finally:
        launch.stop()
        _kill_leftovers(launch, rec)


# ---------------------------------------------------------------- SGLang launcher, for real


async def test_sglang_launcher_end_to_end(tmp_path: Path) -> None:
    http, kvb, rec, env = _launch_env(tmp_path, "sglang")
    env.update(GPUS_PER_WORKER="2", PYTHONPATH=str(ROOT))
    launch = Launch(SGLANG_SCRIPT, ["2", DEMO_MODEL, "--served-model-name", "demo"], env)
    runner = None
    try:
        line = launch.serve_line()
        cfg = _serve_config(line)
        assert cfg.model_names == ["demo"]
        assert [w.id for w in cfg.workers] == ["sglang-0", "sglang-1"]
        for i, w in enumerate(cfg.workers):
            # /server_info advertises kv_events: only the URL (and replay) in the spec.
            assert w.url == f"http://127.0.0.1:{http + i}" and not w.kv_explicit
            assert w.replay_endpoint == f"tcp://127.0.0.1:{kvb + 2 * i + 1}"
        assert "SGLang 0.5.23, page size 16, KV endpoint discovered" in launch.stderr

        records = _records(rec)
        for i in range(2):
            r = records[http + i]
            argv = r["argv"]
            assert argv[:4] == ["-m", "sglang.launch_server", "--model-path", DEMO_MODEL]
            assert json.loads(argv[argv.index("--kv-events-config") + 1]) == {
                "publisher": "zmq", "endpoint": f"tcp://*:{kvb + 2 * i}",
                "replay_endpoint": f"tcp://*:{kvb + 2 * i + 1}", "topic": ""}
            assert argv[argv.index("--page-size") + 1] == "16"
            assert "--enable-cache-report" in argv and "--enable-metrics" in argv
            assert argv[argv.index("--tp-size") + 1] == "2"
            assert r["cuda"] == f"{2 * i},{2 * i + 1}"

        ctx = AppContext(cfg)
        runner, port = await start_background(cfg, ctx)
        await _route_through(ctx, port, "/flush_cache")
        for i, w in enumerate(cfg.workers):
            live = ctx.registry.get(w.id)
            assert live.backend == "sglang" and live.page_size == 16
            assert [(s.endpoint, s.replay_endpoint) for s in live.kv_sources] == [
                (f"tcp://127.0.0.1:{kvb + 2 * i}", f"tcp://127.0.0.1:{kvb + 2 * i + 1}")]

        launch.proc.send_signal(signal.SIGTERM)
        assert launch.wait() == 143
        assert sorted(launch.worker_pids()) == sorted(r["pid"] for r in records.values())
        assert _wait_gone(launch.worker_pids()) == []
    finally:
        if runner is not None:
            await runner.cleanup()
        launch.stop()
        _kill_leftovers(launch, rec)


# ---------------------------------------------------------------- Dockerfile


def _dockerfile() -> dict[str, list[str]]:
    """Instructions by keyword (continuation lines joined)."""
    out: dict[str, list[str]] = {}
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, _, rest = line.partition(" ")
            out.setdefault(key.upper(), []).append(rest.strip())
    return out


def test_dockerfile() -> None:
    d = _dockerfile()
    assert d["FROM"] == ["python:3.11-slim"]
    assert json.loads(d["ENTRYPOINT"][-1]) == ["mmroute"]
    cmd = json.loads(d["CMD"][-1])
    args = build_parser().parse_args(cmd)
    assert args.command == "serve" and args.host == "0.0.0.0" and args.port == 8000
    assert d["EXPOSE"] == ["8000"]
    users = d["USER"]
    assert users and users[-1] not in ("root", "0")
    assert any("pip install ." in r for r in d["RUN"])
    assert not any("torch" in r and "pip install" in r and "show" not in r for r in d["RUN"])
    hc = d["HEALTHCHECK"][-1]
    assert "http://127.0.0.1:8000/health" in hc and "curl" not in hc
    # The demo model path compose's cpu profile uses is created here.
    assert any("/opt/mmroute/demo-model" in r for r in d["RUN"])


# ---------------------------------------------------------------- compose


def _interpolate(value: str) -> str:
    """Compose variable syntax with the defaults (${VAR:-default} / ${VAR})."""
    return re.sub(r"\$\{(\w+)(?::?-([^}]*))?\}", lambda m: m.group(2) or "", value)


def _compose() -> dict[str, Any]:
    data = yaml.safe_load(COMPOSE.read_text())
    assert isinstance(data, dict) and isinstance(data.get("services"), dict)
    return data


def _cmd(svc: dict[str, Any]) -> list[str]:
    cmd = svc.get("command")
    assert isinstance(cmd, list) and all(isinstance(c, str) for c in cmd), f"command must be a list of strings: {cmd!r}"
    return [_interpolate(c) for c in cmd]


def _opt(argv: list[str], name: str) -> str:
    assert name in argv, f"{name} missing in {argv}"
    return argv[argv.index(name) + 1]


def _port(endpoint: str) -> int:
    return int(endpoint.rsplit(":", 1)[1])


def _worker_facts(svc: dict[str, Any]) -> dict[str, Any]:
    """(kind, http port, kv port, replay port) read from a worker service's own command."""
    image = svc.get("image", "")
    cmd = _cmd(svc)
    if image.startswith("vllm/vllm-openai"):
        assert svc.get("entrypoint") == ["vllm", "serve"]
        assert "--enable-prefix-caching" in cmd and "--enable-prompt-tokens-details" in cmd
        kv = json.loads(_opt(cmd, "--kv-events-config"))
        assert kv["enable_kv_cache_events"] is True and kv["publisher"] == "zmq"
        return {"kind": "vllm", "http": int(_opt(cmd, "--port")), "kv": kv["endpoint"], "replay": kv["replay_endpoint"]}
    if image.startswith("lmsysorg/sglang"):
        assert cmd[:3] == ["python3", "-m", "sglang.launch_server"]
        assert int(_opt(cmd, "--page-size")) >= 16
        assert "--enable-cache-report" in cmd and "--enable-metrics" in cmd
        kv = json.loads(_opt(cmd, "--kv-events-config"))
        assert kv["publisher"] == "zmq"
        return {"kind": "sglang", "http": int(_opt(cmd, "--port")), "kv": kv["endpoint"], "replay": kv["replay_endpoint"]}
    assert cmd[0] == "sim-worker", f"unknown worker service {svc}"
    args = build_parser().parse_args(cmd)
    sim = config_from_args(args)  # the simulator accepts these flags
    assert sim.host == "0.0.0.0"
    return {"kind": "sim-" + sim.backend, "http": sim.port, "kv": sim.kv_endpoint, "replay": sim.replay_endpoint}


def test_compose_profiles_and_router_specs() -> None:
    data = _compose()
    services: dict[str, dict[str, Any]] = data["services"]
    by_profile: dict[str, list[str]] = {}
    for name, svc in services.items():
        profiles = svc.get("profiles")
        assert isinstance(profiles, list) and len(profiles) == 1, f"{name}: exactly one profile"
        by_profile.setdefault(profiles[0], []).append(name)
    assert set(by_profile) == {"cpu", "gpu", "sglang"}
    expected_kinds = {"cpu": ("sim-vllm", 3), "gpu": ("vllm", 2), "sglang": ("sglang", 2)}

    for profile, names in by_profile.items():
        routers = [n for n in names if _cmd(services[n])[0] == "serve"]
        assert len(routers) == 1, f"profile {profile}: one router"
        router = services[routers[0]]
        assert router.get("image") == "mmroute:local" and router["build"]["dockerfile"] == "docker/Dockerfile"
        assert router.get("ports") == ["${ROUTER_PORT:-8000}:8000"]
        args = build_parser().parse_args(_cmd(router))
        flags = {k: v for k, v in vars(args).items() if k not in ("command", "config", "func")}
        cfg = build_config({}, flags)
        cfg.validate()
        assert cfg.host == "0.0.0.0" and cfg.port == 8000

        workers = [n for n in names if n != routers[0]]
        kind, count = expected_kinds[profile]
        assert len(workers) == count
        assert sorted(w.host for w in cfg.workers) == sorted(workers), "one spec per worker service, by service name"
        assert router.get("depends_on") == {w: {"condition": "service_healthy"} for w in workers}
        gpus = []
        for spec in cfg.workers:
            svc = services[spec.host]
            facts = _worker_facts(svc)
            assert facts["kind"] == kind
            assert spec.name == spec.host
            assert urlsplit(spec.url).port == facts["http"]
            # The publisher binds inside its container; the router dials the service name.
            assert facts["kv"] == "tcp://*:5557" and facts["replay"] == "tcp://*:5558"
            assert spec.kv_endpoint == f"tcp://{spec.host}:5557"  # given, or the default SGLang discovery falls back to
            assert spec.replay_endpoint == f"tcp://{spec.host}:5558"
            hc = svc.get("healthcheck") or {}
            assert f"http://127.0.0.1:{facts['http']}/health" in " ".join(hc.get("test", [])), f"{spec.host}: healthcheck"
            if kind in ("vllm", "sglang"):
                dev = svc["deploy"]["resources"]["reservations"]["devices"]
                assert dev[0]["capabilities"] == ["gpu"]
                gpus += dev[0]["device_ids"]
                assert svc.get("ipc") == "host"
            else:
                assert "deploy" not in svc and svc.get("image") == "mmroute:local"
        assert len(gpus) == len(set(gpus)), f"profile {profile}: one GPU per worker"
        if kind == "sglang":
            assert not any(w.kv_explicit for w in cfg.workers), "SGLang workers: KV endpoint discovered"
        if kind == "sim-vllm":
            assert cfg.model == "/opt/mmroute/demo-model"


def test_compose_cli_validation() -> None:
    """`docker compose config -q` where a compose client is installed (no engine needed)."""
    for cmd in (["docker", "compose"], ["docker-compose"]):
        exe = shutil.which(cmd[0])
        if exe is None:
            continue
        if subprocess.run([*cmd, "version"], capture_output=True).returncode != 0:
            continue
        for profile in ("cpu", "gpu", "sglang"):
            r = subprocess.run([*cmd, "-f", str(COMPOSE), "--profile", profile, "config", "-q"],
                               capture_output=True, text=True, env={**os.environ, "HF_TOKEN": ""})
            assert r.returncode == 0, f"{' '.join(cmd)} config ({profile}): {r.stderr}"
        return
    pytest.skip("no docker compose client installed (apt-get install docker-compose)")


# ---------------------------------------------------------------- docs stay complete


def test_docs_cover_every_flag_key_and_metric() -> None:
    """docs/configuration.md names every serve flag and TOML key; docs/metrics.md every
    metric as exported (a new flag or metric without docs fails here)."""
    import dataclasses

    from mmroute.metrics import Metrics

    conf = (ROOT / "docs" / "configuration.md").read_text()
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    serve = sub.choices["serve"]
    flags = [s for action in serve._actions for s in action.option_strings if s.startswith("--") and s != "--help"]
    assert len(flags) > 20
    missing = [f for f in flags if f"`{f}`" not in conf]
    assert not missing, f"flags missing from docs/configuration.md: {missing}"
    keys = [f.name for f in dataclasses.fields(RouterConfig)]
    missing = [k for k in keys if f"`{k}`" not in conf]
    assert not missing, f"TOML keys missing from docs/configuration.md: {missing}"

    text = (ROOT / "docs" / "metrics.md").read_text()
    from prometheus_client import Counter, Histogram

    m = Metrics()
    names = []
    for obj in vars(m).values():
        if isinstance(obj, (Counter, Histogram)) or type(obj).__name__ == "Gauge":
            name = obj._name  # type: ignore[attr-defined]
            names.append(name + "_total" if isinstance(obj, Counter) else name)
    assert len(names) > 20
    missing = [n for n in names if f"`{n}`" not in text]
    assert not missing, f"metrics missing from docs/metrics.md: {missing}"
