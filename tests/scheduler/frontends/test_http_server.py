"""HttpServer: uvicorn on its own thread, its housekeeping tick once a second, stopped at once."""

import http.client
import time

from scheduler_service.frontends.http_server import HttpServer


async def hello(scope, receive, send):
    """A minimal ASGI app: 200 and a body for every HTTP request."""
    if scope["type"] != "http":
        return
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
    await send({"type": "http.response.body", "body": b"hello"})


def test_an_idle_server_ticks_once_a_second_and_stops_at_once():
    """uvicorn's own loop ticks ten times a second (half an idle scheduler's CPU); ours once, and stop() does not
    wait for the tick."""
    server = HttpServer(hello, "127.0.0.1", 0)
    ticks = []
    on_tick = server._server.on_tick

    async def counting(counter):
        ticks.append(time.monotonic())
        return await on_tick(counter)

    server._server.on_tick = counting
    server.start()
    try:
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
        conn.request("GET", "/")
        response = conn.getresponse()
        assert response.status == 200 and response.read() == b"hello"
        assert response.getheader("date")  # the tick still keeps the Date header
        conn.close()
        first = len(ticks)
        time.sleep(2.5)
        assert 1 <= len(ticks) - first <= 4  # uvicorn's loop: ~25
    finally:
        start = time.monotonic()
        server.stop()
        assert time.monotonic() - start < 0.9  # woken, not waiting out the second
