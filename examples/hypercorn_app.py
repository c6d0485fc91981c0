"""An ASGI app behind a PROXY-protocol load balancer, served by Hypercorn.

Needs ``pip install 'tlsedge[hypercorn]'``. Run it under asyncio (``python
examples/hypercorn_app.py``) or trio (``python examples/hypercorn_app.py
trio``), or from the command line with any hypercorn option::

    python -m proxyproto.hypercorn examples.hypercorn_app:app \\
        --bind 127.0.0.1:8000 --worker-class trio --proxy-trusted 127.0.0.1,10.0.0.0/8

``scheme`` is ``https`` when the load balancer terminated TLS and said so in
the header's SSL TLV (HAProxy ``send-proxy-v2-ssl``).

Try it without a load balancer::

    printf 'PROXY TCP4 192.0.2.1 192.0.2.2 4242 80\\r\\nGET / HTTP/1.0\\r\\n\\r\\n' \\
        | nc 127.0.0.1 8000
"""

from __future__ import annotations

import asyncio
import json
import sys
from functools import partial
from typing import Any

from hypercorn.config import Config

import proxyproto.hypercorn


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """Reply with the real client address and the header's TLVs."""
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            await send({"type": message["type"] + ".complete"})
            if message["type"] == "lifespan.shutdown":
                return
    if scope["type"] != "http":
        return
    info = scope["extensions"].get("proxyproto")  # {"header": ..., "peer": ...}
    header = info["header"] if info else None
    reply = {
        "client": scope["client"],  # from the PROXY header
        "server": scope["server"],
        "scheme": scope["scheme"],  # https if the client used TLS to the LB
        "load_balancer": info["peer"] if info else None,
        "tlvs": [(tlv.type, tlv.value.hex()) for tlv in header.tlvs] if header else [],
        "unique_id": header.unique_id.hex() if header and header.unique_id else None,
    }
    print(reply)
    await send(
        {
            "type": "http.response.start",
            "status": 200,
            "headers": [(b"content-type", b"application/json")],
        }
    )
    await send({"type": "http.response.body", "body": json.dumps(reply).encode()})


def main() -> None:
    """Serve on 127.0.0.1:8000 until Ctrl+C."""
    config = Config()
    config.bind = ["127.0.0.1:8000"]
    # config.certfile, config.keyfile = "cert.pem", "key.pem"  # TLS after the header
    trusted = ["127.0.0.1", "10.0.0.0/8"]  # who must send a header
    if sys.argv[1:] == ["trio"]:
        import trio

        trio.run(partial(proxyproto.hypercorn.serve, app, config, trusted=trusted))
    else:
        asyncio.run(proxyproto.hypercorn.serve(app, config, trusted=trusted))


if __name__ == "__main__":
    main()
