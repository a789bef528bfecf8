"""mg's request/reply channel (runtime/channel.py): the experimental spin before a blocking poll
(serve --mg-ipc-spin-us) must change only how a reply is waited for, never what arrives."""

import threading
import time

import pytest
import zmq

from mg_server.runtime import protocol as P
from mg_server.runtime.channel import RpcClient, wait_readable


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


@pytest.mark.parametrize("spin_s,delay_s", [(0.0, 0.0), (0.05, 0.0), (0.05, 0.01), (0.002, 0.02)])
def test_a_spinning_call_gets_the_same_replies(tmp_path, spin_s, delay_s):
    """Replies inside the spin window, after it (delay > spin: the blocking poll takes over), or
    with no spin at all: every call gets its own answer."""
    endpoint = f"ipc://{tmp_path}/c.sock"
    th = _echo_server(endpoint, 3, delay_s)
    with RpcClient(str(tmp_path / "c.sock"), timeout_s=5, spin_s=spin_s) as c:
        for k in range(1, 4):
            reply = c.call(P.Stops())
            assert isinstance(reply, P.Ack) and reply.n == k  # its own answer, in order
    th.join(5)


def test_wait_readable_spins_then_blocks_and_times_out(tmp_path):
    ctx = zmq.Context.instance()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    a.bind(f"ipc://{tmp_path}/p.sock")
    b.connect(f"ipc://{tmp_path}/p.sock")
    try:
        t0 = time.monotonic()
        assert not wait_readable(b, 20, t0 + 0.03)  # spin 30 ms, then poll 20 ms: nothing came
        assert time.monotonic() - t0 >= 0.045
        threading.Timer(0.01, lambda: a.send(b"x")).start()
        assert wait_readable(b, 1000, time.monotonic() + 0.5)  # arrives during the spin
        assert b.recv() == b"x"
        threading.Timer(0.05, lambda: a.send(b"y")).start()
        assert wait_readable(b, 1000, time.monotonic() + 0.001)  # arrives during the blocking poll
        assert b.recv() == b"y"
    finally:
        a.close(0)
        b.close(0)


def test_serve_ipc_spin_flag_reaches_the_config(monkeypatch, prepared_model, capsys):
    from mg_server import cli
    from mg_server.sglang_ext import launch

    seen = []
    monkeypatch.setattr(launch, "serve", seen.append)
    assert cli.main(["serve", "--model", str(prepared_model), "--device", "cpu", "--mg-ipc-spin-us", "500"]) == 0
    assert seen[0].ipc_spin_s == pytest.approx(5e-4)
    assert cli.main(["serve", "--model", str(prepared_model), "--device", "cpu"]) == 0
    assert seen[1].ipc_spin_s == 0.0  # off by default
    try:
        rc = cli.main(["serve", "--model", str(prepared_model), "--device", "cpu", "--mg-ipc-spin-us", "-1"])
    except SystemExit as e:
        rc = e.code
    assert rc == 2 and "--mg-ipc-spin-us" in capsys.readouterr().err
