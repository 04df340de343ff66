"""The baseline: a minimal pass-through OpenAI proxy in aiohttp, as a user would write in ~50 lines.

    python bench/minimal_proxy.py --port 8001 --upstream http://127.0.0.1:8002

No validation, routing, metrics or logs: what any gateway must beat to justify its features.
"""

from __future__ import annotations

import argparse

import aiohttp
from aiohttp import web


def make_app(upstream: str) -> web.Application:
    app = web.Application()

    async def start_session(app: web.Application) -> None:
        app["session"] = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))

    async def close_session(app: web.Application) -> None:
        await app["session"].close()

    async def proxy(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        session: aiohttp.ClientSession = request.app["session"]
        async with session.post(upstream + request.path, data=body,
                                headers={"content-type": "application/json"}) as upstream_response:
            content_type = upstream_response.headers.get("content-type", "application/json")
            if not content_type.startswith("text/event-stream"):
                return web.Response(status=upstream_response.status, body=await upstream_response.read(),
                                    headers={"content-type": content_type})
            response = web.StreamResponse(status=upstream_response.status, headers={"content-type": content_type})
            await response.prepare(request)
            async for chunk in upstream_response.content.iter_any():
                await response.write(chunk)
            await response.write_eof()
            return response

    app.router.add_post("/v1/{tail:.*}", proxy)
    app.on_startup.append(start_session)
    app.on_cleanup.append(close_session)
    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8001)
    parser.add_argument("--upstream", required=True, help="http://host:port of the OpenAI-compatible server")
    args = parser.parse_args()
    try:
        import uvloop

        uvloop.install()  # the fair baseline: the same event loop the gateway uses
    except ImportError:
        pass
    web.run_app(make_app(args.upstream.rstrip("/")), host=args.host, port=args.port, access_log=None,
                print=None)


if __name__ == "__main__":
    main()
