"""What reading the ClientHello's server name costs a TLS handshake, in-process.

Run: ``python bench/client_hello.py [--reps 5]``

`tlsedge._tls.client_hello.ServerNameCheck` reads every ClientHello before OpenSSL
does (a non-ASCII server name would make Python's ``ssl`` print a traceback).
This times it on a real ClientHello from Python's ``ssl`` (TLS 1.3, the SNI
``edge.test``) against the server's own work on that ClientHello: OpenSSL
reading it and writing the first flight (ServerHello ... Finished, with an
ECDSA P-256 signature), both on ``ssl.MemoryBIO`` pairs, no sockets. Best
of *reps* runs each; prints microseconds and the check's share.
"""

from __future__ import annotations

import argparse
import contextlib
import ssl
import timeit

import trustme

from tlsedge._tls.client_hello import ServerNameCheck


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()

    ca = trustme.CA(key_type=trustme.KeyType.ECDSA)
    server_context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ca.issue_cert("edge.test").configure_cert(server_context)
    client_context = ssl.create_default_context()
    ca.configure_trust(client_context)

    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    client = client_context.wrap_bio(incoming, outgoing, server_hostname="edge.test")
    with contextlib.suppress(ssl.SSLWantReadError):
        client.do_handshake()
    hello = outgoing.read()

    def check() -> None:
        ServerNameCheck().feed(hello)

    def first_flight() -> None:
        into, out = ssl.MemoryBIO(), ssl.MemoryBIO()
        server = server_context.wrap_bio(into, out, server_side=True)
        into.write(hello)
        with contextlib.suppress(ssl.SSLWantReadError):
            server.do_handshake()

    checks, flights = 20000, 500
    check_us = min(timeit.repeat(check, number=checks, repeat=args.reps)) / checks
    flight_us = (
        min(timeit.repeat(first_flight, number=flights, repeat=args.reps)) / flights
    )
    print(f"ClientHello: {len(hello)} bytes")
    print(f"server name check:           {check_us * 1e6:8.1f} us")
    print(f"server's first flight (ssl): {flight_us * 1e6:8.1f} us")
    print(f"check / first flight:        {check_us / flight_us:8.2%}")


if __name__ == "__main__":
    main()
