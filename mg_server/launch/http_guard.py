"""A bound on how long a connection may take to send a request's head (main process).

uvicorn (SGLang's HTTP server) waits without limit for the headers of a request, on a new
connection and between keep-alive requests once bytes have come: 200 half-open connections each
held a socket and a buffer for as long as their clients liked. mg closes a connection whose
request head is not complete `HEAD_TIMEOUT_S` after it opened or after the head's first bytes
(the front bounds the body: FrontConfig.body_timeout_s). An idle keep-alive connection stays
uvicorn's (its own keep-alive timer).

Both of uvicorn's HTTP protocols (h11, httptools) are patched the same way: a request is in
progress from its head's end (`cycle`, created then) until its response is complete.
"""

from __future__ import annotations

import asyncio
import logging

log = logging.getLogger(__name__)

# Why 10 s: a request head is a few hundred bytes; clients that need longer are stalled or hostile.
HEAD_TIMEOUT_S = 10.0


def _protocols() -> list[type]:
    out = []
    from uvicorn.protocols.http.h11_impl import H11Protocol

    out.append(H11Protocol)
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError:  # (httptools not installed: uvicorn serves h11)
        return out
    return out + [HttpToolsProtocol]


def _waiting_for_head(proto) -> bool:
    """No request in progress and not idle between requests (uvicorn's keep-alive timer owns that)."""
    cycle = getattr(proto, "cycle", None)
    idle = getattr(proto, "timeout_keep_alive_task", None) is not None
    return (cycle is None or cycle.response_complete) and not idle


def _expire(proto) -> None:
    proto.mg_head_timer = None
    transport = getattr(proto, "transport", None)
    if transport is not None and not transport.is_closing() and _waiting_for_head(proto):
        log.info("mg: closing a connection whose request head did not arrive within %.0f s", proto.mg_head_timeout)
        transport.close()


def _arm(proto) -> None:
    if getattr(proto, "mg_head_timer", None) is None:
        proto.mg_head_timer = asyncio.get_running_loop().call_later(proto.mg_head_timeout, _expire, proto)


def _disarm(proto) -> None:
    timer = getattr(proto, "mg_head_timer", None)
    if timer is not None:
        timer.cancel()
        proto.mg_head_timer = None


def install(timeout_s: float = HEAD_TIMEOUT_S) -> None:
    """Patch uvicorn's HTTP protocols (idempotent); RuntimeError if they lack what this needs."""
    for cls in _protocols():
        if getattr(cls, "mg_head_timeout", None) is not None:
            cls.mg_head_timeout = timeout_s
            continue
        for name in ("connection_made", "data_received", "connection_lost"):
            if not callable(getattr(cls, name, None)):
                raise RuntimeError(f"mg: uvicorn's {cls.__name__} has no {name}; the request-head bound cannot attach")
        made, received, lost = cls.connection_made, cls.data_received, cls.connection_lost

        def connection_made(self, transport, _made=made):
            _made(self, transport)
            _arm(self)

        def data_received(self, data, _received=received):
            _received(self, data)
            if _waiting_for_head(self):
                _arm(self)
            else:
                _disarm(self)

        def connection_lost(self, exc, _lost=lost):
            _disarm(self)
            _lost(self, exc)

        cls.connection_made, cls.data_received, cls.connection_lost = connection_made, data_received, connection_lost
        cls.mg_head_timeout = timeout_s
