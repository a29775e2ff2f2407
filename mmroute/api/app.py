"""The aiohttp application: wiring the context's lifecycle into the server's."""

from __future__ import annotations

import logging

from aiohttp import web

from mmroute.api.context import AppContext
from mmroute.api.handlers import CTX, add_routes, error_middleware
from mmroute.config import RouterConfig

log = logging.getLogger("mmroute")


def create_app(config: RouterConfig, ctx: AppContext | None = None) -> web.Application:
    """Build the router app. The context (model files, tokenizer) loads here, once;
    background tasks start with the server and stop with it."""
    ctx = ctx or AppContext(config)
    # Base64 images travel in the JSON body: allow what the media limit allows, plus JSON overhead.
    app = web.Application(middlewares=[error_middleware], client_max_size=2 * config.media_max_bytes + (1 << 20))
    app[CTX] = ctx
    add_routes(app)

    async def on_startup(_app: web.Application) -> None:
        await ctx.start()

    async def on_cleanup(_app: web.Application) -> None:
        await ctx.stop()

    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    return app


def run(config: RouterConfig) -> None:
    """Serve until interrupted (``mmroute serve``)."""
    try:
        import uvloop

        uvloop.install()
    except ImportError:  # pragma: no cover - uvloop is a dependency on every supported platform
        pass
    app = create_app(config)
    log.info("mmroute listening on http://%s:%d (policy %s, %d workers)", config.host, config.port, config.policy,
             len(config.workers))
    web.run_app(app, host=config.host, port=config.port, print=None, access_log=None,
                handle_signals=True, shutdown_timeout=5.0)


async def start_background(config: RouterConfig, ctx: AppContext | None = None) -> tuple[web.AppRunner, int]:
    """Start the router inside a running loop (tests, ``mmroute demo``); returns the runner and port."""
    app = create_app(config, ctx)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, config.host, config.port)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, port


__all__ = ["create_app", "run", "start_background"]
