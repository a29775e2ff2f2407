"""``mmroute demo``: simulated workers + the router on loopback, offline, in one command.

Also home of ``SimProcess``: launching ``mmroute sim-worker`` as a separate process and
waiting for its ready line, which the end-to-end tests use too.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

READY_PREFIX = "SIM_READY "


def demo_model_path() -> str:
    """The embedded model (Qwen2.5-VL-7B-Instruct's tokenizer, template and configs; no weights)."""
    return str(resources.files("mmroute") / "demo_model")


@dataclass
class SimProcess:
    """A ``mmroute sim-worker`` child process, ready once it printed its ready line."""

    proc: subprocess.Popen
    info: dict[str, Any]
    log_lines: list[str] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.info['port']}"

    def spec(self, name: str | None = None, replay: bool = True) -> str:
        s = f"{self.url},kv={self.info['kv_endpoint']}"
        if replay and self.info.get("replay_endpoint"):
            s += f",replay={self.info['replay_endpoint']}"
        if name:
            s += f",name={name}"
        return s

    @classmethod
    def start(cls, args: list[str], timeout: float = 60.0, env: dict[str, str] | None = None) -> "SimProcess":
        cmd = [sys.executable, "-m", "mmroute", "sim-worker", *args]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                                env={**os.environ, **(env or {})})
        lines: list[str] = []
        ready = threading.Event()
        info: dict[str, Any] = {}

        def pump() -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                lines.append(line.rstrip("\n"))
                if line.startswith(READY_PREFIX) and not ready.is_set():
                    info.update(json.loads(line[len(READY_PREFIX):]))
                    ready.set()
            ready.set()  # process exited

        threading.Thread(target=pump, daemon=True).start()
        if not ready.wait(timeout) or not info:
            proc.kill()
            tail = "\n".join(lines[-30:])
            raise RuntimeError(f"sim-worker did not become ready (exit {proc.poll()}):\n{tail}")
        return cls(proc, info, lines)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


def run_demo(args: argparse.Namespace) -> int:
    from mmroute.api.app import start_background
    from mmroute.config import RouterConfig, WorkerSpec

    model = demo_model_path()
    sims = []
    try:
        for i in range(args.workers):
            sims.append(SimProcess.start(["--model", model, "--served-model-name", "demo", "--port", "0",
                                          "--num-blocks", "4096", "--log-level", "warning"]))
        cfg = RouterConfig(model=model, served_model_name=["demo"], port=args.port,
                           workers=[WorkerSpec.parse(s.spec(name=f"sim-{i}")) for i, s in enumerate(sims)])
        cfg.validate()

        async def serve() -> None:
            runner, port = await start_background(cfg)
            url = f"http://127.0.0.1:{port}"
            print(_banner(url, [s.url for s in sims]), flush=True)
            try:
                await asyncio.Event().wait()
            finally:
                await runner.cleanup()

        try:
            import uvloop

            uvloop.install()
        except ImportError:  # pragma: no cover
            pass
        asyncio.run(serve())
    except KeyboardInterrupt:
        pass
    finally:
        for s in sims:
            s.stop()
    return 0


def _banner(url: str, workers: list[str]) -> str:
    return f"""
mmroute demo: router at {url} in front of {len(workers)} simulated vLLM workers
  ({', '.join(workers)}); model "demo" = Qwen2.5-VL-7B-Instruct's tokenizer and template.

Try it:

  curl -s {url}/v1/chat/completions -H 'content-type: application/json' -d '{{
    "model": "demo",
    "messages": [{{"role": "system", "content": "You are a helpful assistant who knows the fleet."}},
                 {{"role": "user", "content": "Why does prefix-cache-aware routing matter?"}}],
    "max_tokens": 16}}'

  curl -s '{url}/router/explain?tokens=1' -H 'content-type: application/json' -d '{{
    "model": "demo", "messages": [{{"role": "user", "content": "hello"}}]}}'

  curl -s {url}/router/workers
  curl -s {url}/metrics | grep mmroute_predicted_hit_rate

OpenAI SDK (pip install openai):

  from openai import OpenAI
  client = OpenAI(base_url="{url}/v1", api_key="unused")
  r = client.chat.completions.create(model="demo", max_tokens=16,
        messages=[{{"role": "user", "content": "Say hello"}}])
  print(r.choices[0].message.content, r.usage)

Send the same conversation twice: the second lands on the worker that holds its
prefix, and usage.prompt_tokens_details.cached_tokens shows the hit. Ctrl-C stops.
"""
