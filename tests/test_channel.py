"""mg's request/reply channel (wire/channel.py): every call gets its own reply, in order."""

import threading
import time

import pytest
import zmq

from mg_server.wire import protocol as P
from mg_server.wire.channel import RpcClient


def _echo_server(endpoint: str, n: int, delay_s: float) -> threading.Thread:
    """A ROUTER that answers n calls with an Ack whose n is the call's msg_id, after delay_s."""
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.ROUTER)
    sock.bind(endpoint)

    def serve():
        for _ in range(n):
            ident, data = sock.recv_multipart()
            msg = P.decode(data)
            time.sleep(delay_s)
            reply = P.Ack(n=msg.msg_id)
            reply.msg_id = msg.msg_id
            sock.send_multipart([ident, P.encode(reply)])
        sock.close(0)

    th = threading.Thread(target=serve, daemon=True)
    th.start()
    return th


@pytest.mark.parametrize("delay_s", [0.0, 0.02])
def test_each_call_gets_its_own_reply(tmp_path, delay_s):
    endpoint = f"ipc://{tmp_path}/c.sock"
    th = _echo_server(endpoint, 3, delay_s)
    with RpcClient(str(tmp_path / "c.sock"), timeout_s=5) as c:
        for k in range(1, 4):
            reply = c.call(P.WindowNews())
            assert isinstance(reply, P.Ack) and reply.n == k  # its own answer, in order
    th.join(5)


def test_a_finish_report_never_waits_for_a_busy_controller(tmp_path):
    # the seam's finish watcher sends Finish one way: a controller busy in a long verify call
    # (here: one that reads but never answers) cannot hold the watcher, whose beat /health reads
    from mg_server.controller.client import ControllerClient

    sock = zmq.Context.instance().socket(zmq.ROUTER)
    sock.bind(f"ipc://{tmp_path}/c.sock")
    try:
        with ControllerClient(str(tmp_path / "c.sock"), timeout_s=30, peer_check=lambda: "") as c:
            t0 = time.monotonic()
            for k in range(3):
                c.finish(P.Finish(rid=f"r{k}", output=[1, 2]))
            assert time.monotonic() - t0 < 1.0
            got = []  # (read while the client is open: a closed socket drops what it has not sent)
            while len(got) < 3 and sock.poll(5000):
                got.append(P.decode(sock.recv_multipart()[1]).rid)
        assert got == ["r0", "r1", "r2"]  # delivered, in order
    finally:
        sock.close(0)
