"""Round trip of one small message between two processes over zmq ipc, as mg's channel sends it
(DEALER -> ROUTER): blocking polls vs spinning receivers, back to back vs with a pause between
calls (mg's checks come every few ms, so cores may sleep in between).

    python benchmarks/ipc_pingpong.py [--n 1000] [--out ipc.json]

Why: a held verify call crosses four such hops (seam -> controller -> verifier and back;
benchmarks/verify_timeline.py measured ~0.25 ms each on the H100 host). If most of that is the
receiver's wake-up from a blocking poll, receivers that spin while a reply is due would cut it.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import sys
import tempfile
import time
from pathlib import Path

PAYLOAD = b"x" * 256  # about one StepRow's encoding


def _recv(sock, spin: bool):
    import zmq

    if not spin:
        return sock.recv_multipart()
    while True:
        try:
            return sock.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            pass


def server(endpoint: str, spin: bool, n: int) -> None:
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.bind(endpoint)
    for _ in range(n + 1):
        ident, data = _recv(sock, spin)
        sock.send_multipart([ident, data])
    sock.close(0)
    ctx.term()


def client(endpoint: str, spin: bool, n: int, gap_s: float) -> list[float]:
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(endpoint)
    sock.send(PAYLOAD)  # the connection's first message (slow) is not timed
    _recv(sock, spin)
    out = []
    for _ in range(n):
        if gap_s:
            time.sleep(gap_s)
        t0 = time.perf_counter()
        sock.send(PAYLOAD)
        _recv(sock, spin)
        out.append((time.perf_counter() - t0) * 1e6)
    sock.close(0)
    ctx.term()
    return out


def run(spin_server: bool, spin_client: bool, n: int, gap_s: float) -> dict:
    with tempfile.TemporaryDirectory() as d:
        endpoint = "ipc://" + str(Path(d) / "pp.sock")
        p = mp.get_context("spawn").Process(target=server, args=(endpoint, spin_server, n))
        p.start()
        time.sleep(0.3)
        xs = sorted(client(endpoint, spin_client, n, gap_s))
        p.join(10)
    return {"median_us": statistics.median(xs), "p90_us": xs[int(0.9 * (n - 1))], "n": n}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=1000)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    res = {}
    print("| receivers | pause between calls | round trip median µs | p90 µs |\n|---|---|---|---|")
    for gap in (0.0, 0.003):
        for label, ss, sc in (("both block in poll", False, False), ("server spins", True, False),
                              ("both spin", True, True)):
            r = res[f"{label}, gap {gap * 1e3:g} ms"] = run(ss, sc, args.n, gap)
            print(f"| {label} | {gap * 1e3:g} ms | {r['median_us']:.0f} | {r['p90_us']:.0f} |", flush=True)
    if args.out:
        args.out.write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
