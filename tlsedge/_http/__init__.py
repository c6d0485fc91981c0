"""HTTP reverse proxy mode (``mode = "http"``): HTTP/1.1 and HTTP/2 to clients.

One module per job: `head` (the strict head parser), `body` (framing and the
chunked decoder), `rules` (what a proxy changes in a message), `events` (the
vocabulary between the state machines and their driver), `session` (the client
side, sans-IO), `exchange` (one upstream exchange, sans-IO), `pool` (idle
upstream connections), `upstreams` (where a request's upstream connection comes
from), `upstream_step` (what both drivers decide when an exchange ends), `log`
(the per-request access-log line), `driver` (an HTTP/1.1 connection on the
reactor: `http_connection`), `h2session` (HTTP/2 framing, sans-IO) and
`h2driver` (an HTTP/2 connection on the reactor: `h2_connection`). Import from
the modules: the package imports nothing, so that the pure ones load without
trio.
"""
