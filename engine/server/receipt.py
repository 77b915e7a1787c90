"""When did the server receive a request? The moment its first bytes were parsed.

The handler of an endpoint runs only after uvicorn has parsed the request, the ASGI task has been
scheduled, the middleware and routing have run, and every handler started in the same event-loop
turn (a closed-loop client's burst) has run its synchronous part. Under load that is milliseconds
the client waits and a handler-time stamp never sees. `ReceiptStampingProtocol` is uvicorn's
httptools protocol with one addition: when the parser meets the start of a request
(`on_message_begin`, inside `data_received`), it records `time.perf_counter()` in the ASGI scope
under `RECEIVED_KEY`. `received_elapsed_s(scope)` turns that into seconds ago, which the handler
subtracts from the engine clock.

Run without this protocol (the ASGI app under a test client, or uvicorn's h11 parser), the scope
carries no stamp and `received_elapsed_s` returns 0.0: the handler's own time is the arrival.
"""
from __future__ import annotations

import time

RECEIVED_KEY = "servetwin.received_perf_s"


def received_elapsed_s(scope: dict) -> float:
    """Seconds since the request's first bytes were parsed (0.0 when the scope has no stamp)."""
    t = scope.get(RECEIVED_KEY)
    return 0.0 if t is None else max(0.0, time.perf_counter() - t)


def http_protocol():
    """uvicorn's `http` setting: the httptools protocol class with the receipt stamp, or "auto"
    without httptools (uvicorn then picks its default and handlers stamp arrival themselves)."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError:  # uvicorn without the [standard] extra
        return "auto"

    class ReceiptStampingProtocol(HttpToolsProtocol):
        def on_message_begin(self) -> None:
            t = time.perf_counter()
            super().on_message_begin()
            self.scope[RECEIVED_KEY] = t

    return ReceiptStampingProtocol
