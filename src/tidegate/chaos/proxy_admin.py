"""The fault proxy's admin endpoint (loopback only) and the client the experiment runner drives it with.

  GET    /faults    the faults in force: {"faults": {...}, "summary": "error 500 p=0.3", "listen", "target"}
  PUT    /faults    replace them: a FaultSet document (faults.py), or "pass"; 400 names every problem
  DELETE /faults    back to pass
  GET    /counters  what the proxy did (ProxyCounters)
"""

from __future__ import annotations

import ipaddress

import aiohttp
import orjson
from aiohttp import web

from tidegate.chaos.fault_proxy import FaultProxy
from tidegate.chaos.faults import PASS, FaultSet, parse_fault_set

__all__ = ["start_admin", "AdminClient", "check_loopback"]


def check_loopback(host: str, what: str) -> None:
    """Fault switches and load aimed elsewhere than this machine must be deliberate: refuse them here."""
    if host == "localhost":
        return
    try:
        if ipaddress.ip_address(host).is_loopback:
            return
    except ValueError:
        pass
    raise ValueError(f"{what} must be on loopback, got {host!r}")


def _faults_document(proxy: FaultProxy) -> dict:
    return {"faults": proxy.faults.model_dump(mode="json", exclude_defaults=True), "summary": proxy.faults.summary(),
            "listen": f"{proxy.listen_host}:{proxy.port}", "target": f"{proxy.target_host}:{proxy.target_port}"}


def _json(data: dict, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(data), status=status, content_type="application/json")


def _app(proxy: FaultProxy) -> web.Application:
    async def get_faults(_request: web.Request) -> web.Response:
        return _json(_faults_document(proxy))

    async def put_faults(request: web.Request) -> web.Response:
        try:
            faults = parse_fault_set(orjson.loads(await request.read() or b"null"), "faults")
            proxy.set_faults(faults)
        except (ValueError, orjson.JSONDecodeError) as error:
            return _json({"error": {"message": str(error), "type": "invalid_request_error"}}, status=400)
        return _json(_faults_document(proxy))

    async def delete_faults(_request: web.Request) -> web.Response:
        proxy.set_faults(PASS)
        return _json(_faults_document(proxy))

    async def get_counters(_request: web.Request) -> web.Response:
        return _json(proxy.counters.snapshot())

    app = web.Application()
    app.router.add_get("/faults", get_faults)
    app.router.add_put("/faults", put_faults)
    app.router.add_delete("/faults", delete_faults)
    app.router.add_get("/counters", get_counters)
    return app


async def start_admin(proxy: FaultProxy, host: str, port: int) -> web.AppRunner:
    """Serves the admin endpoint; `await runner.cleanup()` stops it. The port may be 0 (see `runner.addresses`)."""
    check_loopback(host, "the admin endpoint")
    runner = web.AppRunner(_app(proxy), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    return runner


class AdminClient:
    """Switches a running proxy's faults over its admin endpoint, e.g. http://127.0.0.1:9201."""

    def __init__(self, base_url: str, timeout_s: float = 5.0) -> None:
        self.base_url = base_url.rstrip("/")
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._session: aiohttp.ClientSession | None = None  # kept: a switch should cost one request, not a connect

    async def _call(self, method: str, path: str, body: bytes | None = None) -> dict:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(timeout=self._timeout)
        async with self._session.request(method, self.base_url + path, data=body) as response:
            data = orjson.loads(await response.read())
            if response.status != 200:
                raise ValueError(f"{self.base_url}{path}: {data.get('error', {}).get('message', data)}")
            return data

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def set_faults(self, faults: FaultSet) -> str:
        """The summary the proxy reports back for the faults now in force."""
        body = orjson.dumps(faults.model_dump(mode="json", exclude_defaults=True))
        return str((await self._call("PUT", "/faults", body))["summary"])

    async def faults(self) -> dict:
        return await self._call("GET", "/faults")

    async def counters(self) -> dict:
        return await self._call("GET", "/counters")
