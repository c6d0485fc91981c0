"""An ASGI app behind a PROXY-protocol load balancer, served by Uvicorn.

Needs ``pip install 'tlsedge[uvicorn]'``. Run it (the load balancer at
10.0.0.0/8 must send a PROXY v1/v2 header; 127.0.0.1 may too, for a local
test)::

    python examples/uvicorn_app.py
    # or, with any uvicorn option:
    python -m proxyproto.uvicorn examples.uvicorn_app:app --port 8000 \\
        --proxy-trusted 127.0.0.1,10.0.0.0/8   # or PROXYPROTO_TRUSTED=...

Try it without a load balancer::

    printf 'PROXY TCP4 192.0.2.1 192.0.2.2 4242 80\\r\\nGET / HTTP/1.0\\r\\n\\r\\n' \\
        | nc 127.0.0.1 8000

``scheme`` is ``https`` when the load balancer terminated TLS and said so in
the header's SSL TLV (HAProxy ``send-proxy-v2-ssl``)::

    { proxyproto encode --raw --source 192.0.2.1:4242 --destination 192.0.2.2:443 \\
        --ssl-version TLSv1.3; printf 'GET / HTTP/1.0\\r\\n\\r\\n'; } \\
        | nc 127.0.0.1 8000
"""

from __future__ import annotations

import json
from typing import Any

import proxyproto.uvicorn


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """Reply with the real client address and what the header carried."""
    if scope["type"] != "http":
        return
    # scope["client"] / scope["server"] already come from the PROXY header.
    info = scope.get("extensions", {}).get("proxyproto")
    header = info["header"] if info else None
    reply = {
        "client": scope["client"],
        "server": scope["server"],
        "scheme": scope["scheme"],  # https if the client used TLS to the LB
        # The load balancer itself (the TCP peer).
        "load_balancer": info["peer"] if info else None,
        "proxy_command": header.command.name if header else None,
        # TLVs: raw list plus typed accessors for the registered ones.
        "tlvs": [(tlv.type, tlv.value.hex()) for tlv in header.tlvs] if header else [],
        "authority": header.authority if header else None,
        "tls_version_at_lb": header.ssl.version if header and header.ssl else None,
    }
    print(reply)
    body = json.dumps(reply).encode()
    await send(
        {
            "type": "http.response.start",
            "status": 200,
            "headers": [(b"content-type", b"application/json")],
        }
    )
    await send({"type": "http.response.body", "body": body})


if __name__ == "__main__":
    proxyproto.uvicorn.run(
        app,
        host="127.0.0.1",
        port=8000,
        trusted=["127.0.0.1", "10.0.0.0/8"],  # who must send a header
        header_timeout=5.0,
        # Any uvicorn option works, e.g. TLS after the header:
        # ssl_certfile="cert.pem", ssl_keyfile="key.pem",
    )
