"""HTTP/1.1 reverse proxy mode (``mode = "http"``).

One module per job: `head` (the strict head parser), `body` (framing and the
chunked decoder), `rules` (what a proxy changes in a message), `events` (the
vocabulary between the state machines and their driver), `session` (the
client side, sans-IO), `exchange` (one upstream exchange, sans-IO), `pool`
(idle upstream connections), `log` (the per-request access-log line) and
`driver` (the trio code that runs a connection: `serve_http`). Import from the
modules: the package imports nothing, so that the pure ones load without trio.
"""
