"""HTTP, sans-IO: what HTTP mode knows of messages, without sockets or trio.

One module per job: `head` (the strict head parser), `body` (framing and the
chunked decoder), `rules` (what a proxy changes in a message), `gate` (the one
check every request passes before its head goes upstream), `events` (the
vocabulary between the state machines and their driver), `session` (the
HTTP/1.1 client side), `exchange` (one upstream exchange), `h2session` (HTTP/2
framing) and `log` (the per-request access-log line). The I/O half, the client
sides on the reactor and the upstream attempt, is `tlsedge._pipeline.http`.
The package imports nothing, so that these load without trio.
"""
