"""Worker specs, the TOML file and flag precedence, and the CLI's error exits."""

from __future__ import annotations

import subprocess
import sys

import pytest

from mmroute.cli import build_parser, main
from mmroute.config import ConfigError, RouterConfig, WorkerSpec, build_config, load_toml


def test_worker_spec_defaults_and_options():
    w = WorkerSpec.parse("http://10.0.0.5:8000")
    assert (w.url, w.kv_endpoint, w.replay_endpoint, w.id, w.backend, w.kv_explicit) == (
        "http://10.0.0.5:8000", "tcp://10.0.0.5:5557", None, "http://10.0.0.5:8000", "auto", False)
    w = WorkerSpec.parse("http://10.0.0.5:8000/,kv=tcp://10.0.0.5:6000,replay=tcp://10.0.0.5:6001,name=a,backend=sglang")
    assert (w.url, w.kv_endpoint, w.replay_endpoint, w.id, w.backend, w.kv_explicit) == (
        "http://10.0.0.5:8000", "tcp://10.0.0.5:6000", "tcp://10.0.0.5:6001", "a", "sglang", True)


@pytest.mark.parametrize("spec", ["", "10.0.0.5:8000", "http://h:1,kv=10.0.0.5:5557", "http://h:1,color=red",
                                  "http://h:1,backend=trt", "http://h:1,name"])
def test_bad_worker_specs(spec):
    with pytest.raises(ConfigError):
        WorkerSpec.parse(spec)


def test_toml_then_flags_win(tmp_path):
    f = tmp_path / "mmroute.toml"
    f.write_text('model = "m1"\nport = 9000\npolicy = "round-robin"\nworkers = ["http://a:1", "http://b:2,name=b"]\n'
                 'block-size = 32\nmm-processor-kwargs = { max_pixels = 1003520 }\n')
    cfg = build_config(load_toml(str(f)), {"port": 9100, "policy": None})
    assert (cfg.model, cfg.port, cfg.policy, cfg.block_size) == ("m1", 9100, "round-robin", 32)
    assert [w.id for w in cfg.workers] == ["http://a:1", "b"]
    assert cfg.mm_processor_kwargs == {"max_pixels": 1003520}
    cfg.validate()


@pytest.mark.parametrize("body,msg", [
    ('port = "80"', "port"),
    ('temperature = "hot"', "temperature"),
    ("workers = [1, 2]", "workers"),
    ('colour = "blue"', "unknown key"),
    ("allow-page-size-1 = 1", "allow_page_size_1"),
    ("model = [", "cannot read"),
])
def test_toml_errors_name_the_key(tmp_path, body, msg):
    f = tmp_path / "bad.toml"
    f.write_text(body + "\n")
    with pytest.raises(ConfigError, match=msg):
        build_config(load_toml(str(f)), {})


@pytest.mark.parametrize("kwargs,msg", [
    ({}, "--model"),
    ({"model": "m"}, "at least one worker"),
    ({"model": "m", "workers": [WorkerSpec.parse("http://a:1,name=x"), WorkerSpec.parse("http://b:1,name=x")]},
     "duplicate"),
    ({"model": "m", "workers": [WorkerSpec.parse("http://a:1")], "policy": "fastest"}, "--policy"),
    ({"model": "m", "workers": [WorkerSpec.parse("http://a:1")], "verify_tokenization": 2.0}, "fraction"),
])
def test_validate(kwargs, msg):
    with pytest.raises(ConfigError, match=msg):
        RouterConfig(**kwargs).validate()


def test_cli_parses_every_subcommand():
    p = build_parser()
    a = p.parse_args(["serve", "--model", "m", "--workers", "http://a:1", "http://b:2,name=b", "--policy", "kv",
                      "--mm-processor-kwargs", '{"max_pixels": 100}', "--lora-modules", "x", "y"])
    assert a.workers == ["http://a:1", "http://b:2,name=b"] and a.mm_processor_kwargs == {"max_pixels": 100}
    assert p.parse_args(["sim-worker", "--backend", "sglang", "--port", "0"]).backend == "sglang"
    assert p.parse_args(["demo", "--port", "0"]).workers == 2
    assert p.parse_args(["bench", "--iterations", "3"]).iterations == 3


def test_cli_config_error_exits_2(capsys):
    assert main(["serve", "--model", "m"]) == 2
    assert "at least one worker" in capsys.readouterr().err


def test_cli_bad_model_path_is_a_clean_error():
    r = subprocess.run([sys.executable, "-m", "mmroute", "serve", "--model", "/nonexistent/model",
                        "--workers", "http://127.0.0.1:1"], capture_output=True, text=True, timeout=60,
                       env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"})
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr and "mmroute: error:" in r.stderr
