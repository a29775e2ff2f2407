"""Forwarding to workers: OpenAI pass-through, SGLang /generate translation, pooling."""

from mmroute.proxy.common import ProxyHooks, RetryableUpstreamError, Usage
from mmroute.proxy.openai import proxy_openai
from mmroute.proxy.sglang import build_generate_body, generate_unsupported, proxy_sglang_generate
from mmroute.proxy.upstream import Upstream

__all__ = [
    "ProxyHooks",
    "RetryableUpstreamError",
    "Upstream",
    "Usage",
    "build_generate_body",
    "generate_unsupported",
    "proxy_openai",
    "proxy_sglang_generate",
]
