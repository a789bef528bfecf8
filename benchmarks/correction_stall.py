"""Does a missed flip's correction stall other deterministic requests? (CPU or GPU server)

    python benchmarks/correction_stall.py --out FILE.json [--device cpu] [--model DIR]

A missed flip in a non-streamed deterministic answer is completed by the verifier, one verify
call per token (controller/correct.AnswerCompletion), inside the controller, which also decides
every deterministic forward's steps. This starts one server with the test-only fault
MG_FAULT_MISSED_FLIP=3 (every deterministic answer's 4th token is the runner-up, fast-committed:
a missed flip on demand), streams one deterministic request B, and once B is under way sends a
non-streamed deterministic request A whose verdict needs a completion of its remaining tokens.
It reports B's largest gap between two streamed chunks (its last one, which waits for B's own
tail audit, left out), the largest while A was under way (its decode, tail audit and
completion), and B's median gap. JSON in --out.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]


def main() -> None:
    import requests

    from mg_server.evaluation.server_process import ServerProcess
    from mg_server.model.prepare import default_model_dir

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--model", default="")
    ap.add_argument("--a-tokens", type=int, default=60, help="request A's max_new_tokens (its completion's length)")
    ap.add_argument("--b-tokens", type=int, default=400, help="request B's (long enough to outlast A's completion)")
    args = ap.parse_args()
    model = args.model or str(default_model_dir())
    os.environ.update(MG_FAULT_MISSED_FLIP="3")  # (the server inherits it; never set in production)
    log = Path(args.out).with_suffix(".server.log")
    srv = ServerProcess(["--model", model, "--device", args.device, "--mg-mode", "margin"], log)
    try:
        srv.wait_ready()
        hdr = {"X-Deterministic": "1"}
        params = {"temperature": 0, "ignore_eos": True}
        times: list[float] = []

        def stream_b() -> None:
            body = {"text": "Write a long story about a lighthouse keeper.", "stream": True,
                    "sampling_params": {**params, "max_new_tokens": args.b_tokens}}
            with requests.post(srv.url + "/generate", json=body, headers=hdr, stream=True, timeout=600) as r:
                for line in r.iter_lines():
                    if line.startswith(b"data:") and line != b"data: [DONE]":
                        times.append(time.monotonic())

        tb = threading.Thread(target=stream_b)
        tb.start()
        while len(times) < 10:
            time.sleep(0.01)
        t_a0 = time.monotonic()
        body = {"text": "List the planets of the solar system.", "sampling_params": {**params, "max_new_tokens": args.a_tokens}}
        ra = requests.post(srv.url + "/generate", json=body, headers=hdr, timeout=600)
        t_a1 = time.monotonic()
        tb.join()
    finally:
        srv.stop()
    # (the last gap is B's own tail audit before its final chunk, not a stall)
    gaps = [b - a for a, b in zip(times[:-1], times[1:-1])]
    during = [b - a for a, b in zip(times[:-1], times[1:-1]) if a < t_a1 and b > t_a0]  # overlapping A
    text = log.read_text(errors="replace")
    res = {"device": args.device, "a_verdict": ra.headers.get("x-mg-verdict"), "a_ms": 1e3 * (t_a1 - t_a0),
           "a_corrected": "corrected by the verifier" in text, "b_chunks": len(times),
           "b_median_gap_ms": 1e3 * statistics.median(gaps), "b_max_gap_ms": 1e3 * max(gaps),
           "b_max_gap_during_a_ms": 1e3 * max(during) if during else None,
           "completion_lines": [x[-160:] for x in text.splitlines() if "corrected by the verifier" in x]}
    print(json.dumps(res, indent=1))
    Path(args.out).write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
