"""Backend selection: which server gets the next connection.

Pure and synchronous: no I/O, no trio. The edge builds one `Balancer` per backend
and calls `Balancer.pick` once per new upstream connection (and again, with the
failed servers in ``exclude``, for each connect retry).

State lives in `Server` objects that three parties share:

- a `ServerLease` owns one count of `Server.active`: the connection path takes
  one right after a pick (before it awaits the connect, so that concurrent picks
  already see the new connection) and releases it exactly once, when the
  upstream connection closes (tcp mode) or goes back to the keep-alive pool
  (http mode). Nothing else writes ``active``;
- the health checker (`tlsedge._backends.health`) writes `Server.healthy` and
  `Server.down_until`;
- the balancer only reads them, except for its own bookkeeping (smooth
  round-robin weights and the client-IP affinity table), which it keeps to itself.

Every policy looks at each server at most a few times per pick: O(n) in the
number of servers, with no allocation on the common path. Servers are few (tens)
while picks are many (one per connection), so a linear scan over a list beats
anything cleverer.
"""

from __future__ import annotations

import ipaddress
import random
import sys
import time
from collections import OrderedDict
from collections.abc import Callable, Collection, Sequence
from typing import Final

from tlsedge._core.accesslog import format_address

__all__ = [
    "DEFAULT_AFFINITY_TIMEOUT",
    "MAX_AFFINITY_ENTRIES",
    "POLICIES",
    "Balancer",
    "Server",
    "ServerLease",
]

#: The ``balance`` values a backend accepts, in the order the docs list them.
POLICIES: Final = ("round-robin", "least-connections", "random-two", "source-ip")

#: Kubernetes ``sessionAffinityConfig.clientIP.timeoutSeconds`` default (3 hours).
DEFAULT_AFFINITY_TIMEOUT: Final = 10800.0

#: Cap on remembered client IPs for "source-ip". An entry costs about 250 bytes,
#: so this bounds the table near 25 MB. Past the cap the least recently seen
#: client loses its affinity, which only means its next connection is balanced
#: afresh (what kube-proxy does once an entry expires anyway).
MAX_AFFINITY_ENTRIES: Final = 100_000


class Server:
    """One backend server's live state, shared by the balancer, relay and health.

    This is the single mutable object that the health checker (``healthy``,
    ``down_until``) and the relay (``active``) update and that `Balancer.pick`
    reads. Keep the same object for as long as the server stays configured (across
    config reloads and DNS refreshes) so that its state carries over.

    Servers compare and hash by identity, so they can go in ``exclude`` sets.

    Attributes:
        address: Numeric IP host and port, already resolved (resolution happens
            once, elsewhere; nothing on the connection path touches DNS).
        weight: Relative share of new connections, at least 1.
        healthy: False while the server is marked down. Starts True so that
            traffic flows at startup before any health check has run.
        active: Upstream connections in use to this server: the number of
            unreleased `ServerLease` objects (idle pooled connections do not
            count).
        down_until: While the server is down because real traffic failed and no
            active check runs, the `time.monotonic`-style clock value after which
            the balancer offers it traffic again as a trial (half-open). None
            otherwise: a down server with ``down_until`` None stays down until an
            active health check brings it back.
    """

    __slots__ = ("active", "address", "down_until", "healthy", "name", "weight")

    def __init__(self, address: tuple[str, int], weight: int = 1) -> None:
        """Create a healthy server with no connections.

        Args:
            address: ``(host, port)``, host a numeric IPv4 or IPv6 address.
            weight: Relative share of traffic, at least 1.

        Raises:
            ValueError: host is not a numeric IP address, port is outside
                1-65535, or weight is below 1.
        """
        host, port = address
        ipaddress.ip_address(host)  # raises ValueError for names: resolve first
        if not 1 <= port <= 65535:
            raise ValueError(f"port must be 1-65535, got {port}")
        if weight < 1:
            raise ValueError(f"weight must be at least 1, got {weight}")
        self.address: tuple[str, int] = (host, port)
        #: The address as logs and metrics write it (``str(server)``): made
        #: once, not per connection.
        self.name: str = sys.intern(format_address((host, port)))
        self.weight: int = weight
        self.healthy: bool = True
        self.active: int = 0
        self.down_until: float | None = None

    def __str__(self) -> str:
        return self.name

    def __repr__(self) -> str:
        return (
            f"Server({self.address!r}, weight={self.weight}, "
            f"healthy={self.healthy}, active={self.active})"
        )

    def is_available(self, now: float) -> bool:
        """Whether the balancer may send this server a new connection at ``now``.

        True when healthy, or when a passive ejection's cool-down has passed.
        """
        return self.healthy or (self.down_until is not None and now >= self.down_until)


class ServerLease:
    """One use of a server, holding one count of `Server.active` until released.

    The single owner of a server's connection count: whoever picks a server
    takes a lease before connecting and releases it when it is done with the
    connection, whatever the mode. `release` is idempotent, so a cleanup path
    that runs twice (an error, then a ``finally``) cannot count twice.

    Args:
        server: The server in use.
        on_release: Called once with the lease when it is released (metrics).
    """

    __slots__ = ("_on_release", "released", "server")

    def __init__(
        self,
        server: Server,
        on_release: Callable[[ServerLease], None] | None = None,
    ) -> None:
        self.server = server
        self.released = False
        self._on_release = on_release
        server.active += 1

    def release(self) -> None:
        """Give the count back (once; later calls do nothing)."""
        if self.released:
            return
        self.released = True
        self.server.active -= 1
        if self._on_release is not None:
            self._on_release(self)

    def __repr__(self) -> str:
        state = "released" if self.released else "held"
        return f"<ServerLease {self.server} {state}>"


class _Affinity:
    """One client IP's remembered server ("source-ip"); mutated in place."""

    __slots__ = ("last_used", "server")

    def __init__(self, server: Server, last_used: float) -> None:
        self.server = server
        self.last_used = last_used


class Balancer:
    """Chooses a server for each new connection according to a policy.

    Policies (the ``balance`` config key):

    - ``"round-robin"``: smooth weighted round robin, nginx's algorithm: each pick
      adds every eligible server's weight to its running score, takes the highest
      score and subtracts the total weight from it. Weights 5:1:1 give
      a, a, b, a, c, a, a: interleaved, never bursts. One pass, O(n).
    - ``"least-connections"``: fewest ``active / weight``; ties (common at low
      load, when everything is at 0) are broken by smooth weighted round robin
      among the tied servers, as nginx's ``least_conn`` does, so idle backends
      still share traffic by weight. Two passes, O(n).
    - ``"random-two"``: power of two choices: draw two distinct eligible servers at
      random, weighted by weight, and take the one with fewer ``active / weight``
      (HAProxy ``random(2)``, Envoy LEAST_REQUEST). Three passes, O(n).
    - ``"source-ip"``: client-IP affinity (Kubernetes ``sessionAffinity:
      ClientIP``). A client's first pick is weighted round robin and remembered;
      later picks within ``affinity_timeout`` seconds of its *last* use return the
      same server while it is available and not excluded, otherwise a new server
      is picked and remembered. The table is an LRU-ordered dict: a hit is moved
      to the end, and expired entries are popped from the front lazily, so a pick
      costs amortized O(1) dict work plus O(n) on a miss. No client IP (None)
      means plain round robin.

    A server is eligible when `Server.is_available` and it is not in ``exclude``.

    Args:
        servers: The backend's servers (kept by reference; see `set_servers`).
        policy: One of `POLICIES`.
        affinity_timeout: Seconds a "source-ip" entry lives after its last use.
        rng: Random source for "random-two" (seed it in tests).
        clock: Monotonic clock in seconds; the same clock must feed
            `Server.down_until` (the health code's ``clock``).
        max_affinity_entries: Cap on remembered client IPs.

    Raises:
        ValueError: unknown policy, non-positive affinity_timeout or cap, or the
            same Server object listed twice.
    """

    __slots__ = (
        "_affinity",
        "_affinity_timeout",
        "_clock",
        "_current",
        "_max_affinity_entries",
        "_members",
        "_pick_policy",
        "_policy",
        "_rng",
        "_servers",
    )

    def __init__(
        self,
        servers: Sequence[Server],
        policy: str = "round-robin",
        *,
        affinity_timeout: float = DEFAULT_AFFINITY_TIMEOUT,
        rng: random.Random | None = None,
        clock: Callable[[], float] = time.monotonic,
        max_affinity_entries: int = MAX_AFFINITY_ENTRIES,
    ) -> None:
        """Create a balancer; see the class docstring for the arguments."""
        pickers: dict[
            str, Callable[[str | None, Collection[Server], float], Server | None]
        ] = {
            "round-robin": self._pick_round_robin,
            "least-connections": self._pick_least_connections,
            "random-two": self._pick_random_two,
            "source-ip": self._pick_source_ip,
        }
        if policy not in pickers:
            raise ValueError(
                f"unknown policy {policy!r}; choose one of {', '.join(POLICIES)}"
            )
        if not affinity_timeout > 0:
            raise ValueError(f"affinity_timeout must be > 0, got {affinity_timeout}")
        if max_affinity_entries < 1:
            raise ValueError(
                f"max_affinity_entries must be >= 1, got {max_affinity_entries}"
            )
        self._policy = policy
        self._pick_policy = pickers[policy]
        self._affinity_timeout = affinity_timeout
        self._max_affinity_entries = max_affinity_entries
        # Load balancing needs spread, not unpredictability.
        self._rng = rng if rng is not None else random.Random()  # noqa: S311
        self._clock = clock
        self._affinity: OrderedDict[str, _Affinity] = OrderedDict()
        self._servers: list[Server] = []
        self._current: list[int] = []
        self._members: frozenset[Server] = frozenset()
        self.set_servers(servers)

    @property
    def policy(self) -> str:
        """The policy name this balancer was built with."""
        return self._policy

    @property
    def servers(self) -> tuple[Server, ...]:
        """The current servers, in configuration order."""
        return tuple(self._servers)

    def set_servers(self, servers: Sequence[Server]) -> None:
        """Replace the server list (config reload, DNS refresh).

        Pass back the same `Server` objects for servers that stay: their health,
        connection counts and round-robin position carry over. Affinity entries
        pointing at servers no longer listed are replaced when next used.

        Raises:
            ValueError: the same Server object appears twice.
        """
        new = list(servers)
        members = frozenset(new)
        if len(members) != len(new):
            raise ValueError("the same Server object is listed twice")
        previous = dict(zip(self._servers, self._current, strict=True))
        self._servers = new
        self._current = [previous.get(server, 0) for server in new]
        self._members = members

    def pick(
        self, client_ip: str | None = None, *, exclude: Collection[Server] = ()
    ) -> Server | None:
        """Choose the server for a new connection.

        Args:
            client_ip: The client's address (after PROXY unwrapping); used by
                "source-ip", ignored by the other policies.
            exclude: Servers not to choose, e.g. those a retry already failed on
                (so the last retry goes to another server).

        Returns:
            An available server not in ``exclude``, or None when there is none
            (every server down or excluded): the caller then closes the client
            connection cleanly and logs "no healthy server".
        """
        return self._pick_policy(client_ip, exclude, self._clock())

    # -- policies ------------------------------------------------------------
    # Each takes (client_ip, exclude, now). The eligibility test is written out
    # inline (same as Server.is_available) because it runs n times per pick.

    def _pick_round_robin(
        self, client_ip: str | None, exclude: Collection[Server], now: float
    ) -> Server | None:
        servers = self._servers
        current = self._current
        best = -1
        best_score = 0
        total = 0
        for i, server in enumerate(servers):
            if not (
                server.healthy
                or (server.down_until is not None and now >= server.down_until)
            ) or (exclude and server in exclude):
                continue
            weight = server.weight
            score = current[i] + weight
            current[i] = score
            total += weight
            if best < 0 or score > best_score:
                best = i
                best_score = score
        if best < 0:
            return None
        current[best] = best_score - total
        return servers[best]

    def _pick_least_connections(
        self, client_ip: str | None, exclude: Collection[Server], now: float
    ) -> Server | None:
        # Pass 1: the lowest load ratio, compared as active_a * weight_b <
        # active_b * weight_a to stay in integers, and how many servers share it.
        servers = self._servers
        found: Server | None = None
        best_active = 0
        best_weight = 1
        ties = 0
        for server in servers:
            if not (
                server.healthy
                or (server.down_until is not None and now >= server.down_until)
            ) or (exclude and server in exclude):
                continue
            left = server.active * best_weight
            right = best_active * server.weight
            if found is None or left < right:
                found = server
                best_active = server.active
                best_weight = server.weight
                ties = 1
            elif left == right:
                ties += 1
        if ties <= 1:
            return found
        # Pass 2: smooth weighted round robin among the tied servers.
        current = self._current
        best = -1
        best_score = 0
        total = 0
        for i, server in enumerate(servers):
            if (
                server.active * best_weight != best_active * server.weight
                or not (
                    server.healthy
                    or (server.down_until is not None and now >= server.down_until)
                )
                or (exclude and server in exclude)
            ):
                continue
            weight = server.weight
            score = current[i] + weight
            current[i] = score
            total += weight
            if best < 0 or score > best_score:
                best = i
                best_score = score
        current[best] = best_score - total
        return servers[best]

    def _pick_random_two(
        self, client_ip: str | None, exclude: Collection[Server], now: float
    ) -> Server | None:
        total = 0
        count = 0
        for server in self._servers:
            if not (
                server.healthy
                or (server.down_until is not None and now >= server.down_until)
            ) or (exclude and server in exclude):
                continue
            total += server.weight
            count += 1
        if count == 0:
            return None
        first = self._draw(exclude, now, total, None)
        if count == 1:
            return first
        second = self._draw(exclude, now, total - first.weight, first)
        if second.active * first.weight < first.active * second.weight:
            return second
        return first

    def _draw(
        self,
        exclude: Collection[Server],
        now: float,
        total: int,
        skip: Server | None,
    ) -> Server:
        """One eligible server other than ``skip``, chosen with P = weight/total."""
        target = self._rng.random() * total
        cumulative = 0
        last: Server | None = None
        for server in self._servers:
            if (
                server is skip
                or not (
                    server.healthy
                    or (server.down_until is not None and now >= server.down_until)
                )
                or (exclude and server in exclude)
            ):
                continue
            cumulative += server.weight
            last = server
            if target < cumulative:
                return server
        # Only reachable through float rounding at the very top of the range.
        assert last is not None, "caller guarantees an eligible server"
        return last

    def _pick_source_ip(
        self, client_ip: str | None, exclude: Collection[Server], now: float
    ) -> Server | None:
        if client_ip is None:
            return self._pick_round_robin(None, exclude, now)
        table = self._affinity
        timeout = self._affinity_timeout
        # Entries are kept in last-use order, so the expired ones are at the front;
        # each entry is popped at most once, which makes this amortized O(1).
        while table:
            oldest = next(iter(table.values()))
            if now - oldest.last_used < timeout:
                break
            table.popitem(last=False)
        entry = table.get(client_ip)
        if entry is not None:
            server = entry.server
            if (
                server in self._members
                and (
                    server.healthy
                    or (server.down_until is not None and now >= server.down_until)
                )
                and not (exclude and server in exclude)
            ):
                entry.last_used = now
                table.move_to_end(client_ip)
                return server
        chosen = self._pick_round_robin(None, exclude, now)
        if chosen is None:
            return None
        if entry is None:
            table[client_ip] = _Affinity(chosen, now)
            if len(table) > self._max_affinity_entries:
                table.popitem(last=False)
        else:
            entry.server = chosen
            entry.last_used = now
            table.move_to_end(client_ip)
        return chosen
