"""launch/http_guard.py on a real uvicorn server: a connection that never finishes its request head
is closed; one that does is served and kept alive."""

import socket
import threading
import time

import pytest


@pytest.fixture()
def server():
    import uvicorn

    from mg_server.launch import http_guard

    http_guard.install(timeout_s=0.5)

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", http="h11"))
    t = threading.Thread(target=srv.run, daemon=True)
    t.start()
    while not srv.started:
        time.sleep(0.02)
    yield port
    srv.should_exit = True
    t.join(5)
    http_guard.install()  # back to the served bound for later tests of this process


def closed_within(sock: socket.socket, seconds: float) -> bool:
    sock.settimeout(seconds)
    try:
        return sock.recv(100) == b""
    except (socket.timeout, ConnectionResetError):
        return False


def test_a_half_sent_head_is_closed_and_a_whole_one_is_served(server):
    silent = socket.create_connection(("127.0.0.1", server))  # sends nothing
    partial = socket.create_connection(("127.0.0.1", server))
    partial.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n")  # never the blank line
    assert closed_within(silent, 3) and closed_within(partial, 3)
    good = socket.create_connection(("127.0.0.1", server))
    good.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    good.settimeout(3)
    assert good.recv(1000).endswith(b"ok")
    # a second request on the same connection, its head sent slowly but in time
    good.sendall(b"GET / HTTP/1.1\r\n")
    time.sleep(0.2)
    good.sendall(b"Host: x\r\n\r\n")
    assert good.recv(1000).endswith(b"ok")
    # then half a head on the kept-alive connection: closed too
    good.sendall(b"GET / HTTP/1.1\r\n")
    assert closed_within(good, 3)
