from __future__ import annotations

import random
from collections import Counter

import pytest
from hypothesis import given, strategies as st

from tlsedge._core.balancer import POLICIES, Balancer, Server, ServerLease


class FakeClock:
    """A settable monotonic clock."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def make_servers(*weights: int) -> list[Server]:
    return [Server((f"10.0.0.{i + 1}", 8080), w) for i, w in enumerate(weights)]


def names(servers: list[Server], picks: list[Server | None]) -> str:
    letters = {id(s): chr(ord("a") + i) for i, s in enumerate(servers)}
    return "".join(letters[id(p)] if p is not None else "-" for p in picks)


# -- Server ----------------------------------------------------------------


def test_server_defaults_and_str() -> None:
    server = Server(("127.0.0.1", 8080))
    assert server.weight == 1
    assert server.healthy
    assert server.active == 0
    assert server.down_until is None
    assert str(server) == "127.0.0.1:8080"
    assert str(Server(("::1", 443))) == "[::1]:443"
    assert server.name == "127.0.0.1:8080"
    assert Server(("::1", 443)).name == "[::1]:443"
    assert "weight=1" in repr(server)


@pytest.mark.parametrize(
    ("address", "weight"),
    [
        (("app.internal", 80), 1),  # names must be resolved before
        (("127.0.0.1", 0), 1),
        (("127.0.0.1", 65536), 1),
        (("127.0.0.1", 80), 0),
    ],
)
def test_server_rejects_bad_values(address: tuple[str, int], weight: int) -> None:
    with pytest.raises(ValueError, match=r"."):
        Server(address, weight)


def test_server_is_available() -> None:
    server = Server(("127.0.0.1", 80))
    assert server.is_available(0.0)
    server.healthy = False
    assert not server.is_available(0.0)
    server.down_until = 10.0
    assert not server.is_available(9.9)
    assert server.is_available(10.0)


def test_balancer_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="unknown policy 'x'; choose one of"):
        Balancer([], "x")
    with pytest.raises(ValueError, match="affinity_timeout"):
        Balancer([], "source-ip", affinity_timeout=0)
    with pytest.raises(ValueError, match="max_affinity_entries"):
        Balancer([], "source-ip", max_affinity_entries=0)
    server = Server(("127.0.0.1", 80))
    with pytest.raises(ValueError, match="twice"):
        Balancer([server, server])


# -- round robin ---------------------------------------------------------------


def test_smooth_weighted_round_robin_interleaves() -> None:
    servers = make_servers(5, 1, 1)
    balancer = Balancer(servers, "round-robin")
    picks = [balancer.pick(None) for _ in range(14)]
    assert names(servers, picks) == "aabacaa" * 2


def test_round_robin_equal_weights_rotates() -> None:
    servers = make_servers(1, 1, 1)
    balancer = Balancer(servers)
    picks = [balancer.pick("10.1.1.1") for _ in range(9)]
    assert names(servers, picks) == "abc" * 3


def test_round_robin_skips_unhealthy_and_excluded() -> None:
    servers = make_servers(1, 1, 1)
    a, b, c = servers
    balancer = Balancer(servers)
    b.healthy = False
    assert names(servers, [balancer.pick(None) for _ in range(4)]) == "acac"
    assert balancer.pick(None, exclude={a}) is c
    assert balancer.pick(None, exclude=[a, c]) is None


@pytest.mark.parametrize("policy", POLICIES)
def test_none_when_nothing_is_healthy(policy: str) -> None:
    servers = make_servers(1, 2)
    balancer = Balancer(servers, policy, rng=random.Random(1))
    for server in servers:
        server.healthy = False
    assert balancer.pick("192.0.2.1") is None
    assert balancer.pick(None) is None
    assert Balancer([], policy).pick("192.0.2.1") is None


@pytest.mark.parametrize("policy", POLICIES)
def test_exclude_sends_the_retry_elsewhere(policy: str) -> None:
    servers = make_servers(1, 1, 1)
    balancer = Balancer(servers, policy, rng=random.Random(2))
    tried: set[Server] = set()
    for _ in range(3):
        server = balancer.pick("192.0.2.7", exclude=tried)
        assert server is not None
        assert server not in tried
        tried.add(server)
    assert tried == set(servers)
    assert balancer.pick("192.0.2.7", exclude=tried) is None


@pytest.mark.parametrize("policy", POLICIES)
def test_passively_ejected_server_gets_trial_after_cool_down(policy: str) -> None:
    clock = FakeClock()
    (server,) = make_servers(1)
    balancer = Balancer([server], policy, clock=clock, rng=random.Random(3))
    server.healthy = False
    server.down_until = clock.now + 30.0
    assert balancer.pick("192.0.2.1") is None
    clock.now += 30.0
    assert balancer.pick("192.0.2.1") is server


# -- distribution over many picks -------------------------------------------------


WEIGHTS = (5, 3, 2)


def shares(servers: list[Server], picks: list[Server | None]) -> list[float]:
    counts = Counter(id(p) for p in picks)
    return [counts[id(s)] / len(picks) for s in servers]


def expected_shares() -> list[float]:
    return [w / sum(WEIGHTS) for w in WEIGHTS]


@pytest.mark.parametrize("policy", POLICIES)
def test_distribution_matches_weights_idle(policy: str) -> None:
    servers = make_servers(*WEIGHTS)
    balancer = Balancer(servers, policy, rng=random.Random(4))
    picks = [balancer.pick(f"10.{i // 256}.{i % 256}.1") for i in range(10_000)]
    for got, want in zip(shares(servers, picks), expected_shares(), strict=True):
        assert got == pytest.approx(want, abs=0.02)
    if policy != "random-two":
        # Deterministic policies are exact over whole rounds.
        assert [round(s * 10_000) for s in shares(servers, picks)] == [5000, 3000, 2000]


@pytest.mark.parametrize("policy", POLICIES)
def test_distribution_matches_weights_under_load(policy: str) -> None:
    """Connections open on pick and close in random order, 30 at a time."""
    servers = make_servers(*WEIGHTS)
    balancer = Balancer(servers, policy, rng=random.Random(5))
    lifetime = random.Random(6)
    open_connections: list[Server] = []
    picks: list[Server | None] = []
    for i in range(10_000):
        server = balancer.pick(f"10.{i // 256}.{i % 256}.1")
        assert server is not None
        server.active += 1
        open_connections.append(server)
        picks.append(server)
        if len(open_connections) > 30:
            done = open_connections.pop(lifetime.randrange(len(open_connections)))
            done.active -= 1
    for got, want in zip(shares(servers, picks), expected_shares(), strict=True):
        assert got == pytest.approx(want, abs=0.03)


# -- least connections ---------------------------------------------------------


def test_least_connections_prefers_lowest_active_per_weight() -> None:
    servers = make_servers(1, 2, 1)
    a, b, c = servers
    balancer = Balancer(servers, "least-connections")
    a.active, b.active, c.active = 3, 4, 1  # ratios 3, 2, 1
    assert balancer.pick(None) is c
    c.active = 5  # ratios 3, 2, 5
    assert balancer.pick(None) is b
    b.active = 7  # ratios 3, 3.5, 5
    assert balancer.pick(None) is a
    a.healthy = False
    assert balancer.pick(None) is b
    assert balancer.pick(None, exclude={b}) is c


def test_least_connections_ties_rotate() -> None:
    servers = make_servers(1, 1, 1)
    balancer = Balancer(servers, "least-connections")
    for server in servers:
        server.active = 4
    assert names(servers, [balancer.pick(None) for _ in range(6)]) == "abcabc"
    servers[0].active = 9  # a is out of the tie, b and c keep alternating
    assert names(servers, [balancer.pick(None) for _ in range(4)]) in {"bcbc", "cbcb"}


def test_least_connections_ties_are_weighted() -> None:
    servers = make_servers(5, 1, 1)
    balancer = Balancer(servers, "least-connections")
    picks = [balancer.pick(None) for _ in range(7)]
    assert names(servers, picks) == "aabacaa"


# -- random two ------------------------------------------------------------------


def test_random_two_prefers_the_less_loaded() -> None:
    servers = make_servers(1, 1, 1, 1)
    servers[0].active = 100
    servers[1].active = 50
    balancer = Balancer(servers, "random-two", rng=random.Random(7))
    picks = Counter(id(balancer.pick(None)) for _ in range(4000))
    # The busiest server only wins when... never: it is always paired with a
    # less loaded one. The second busiest wins only against the busiest (1/6).
    assert picks[id(servers[0])] == 0
    assert picks[id(servers[1])] == pytest.approx(4000 / 6, rel=0.15)
    assert picks[id(servers[2])] + picks[id(servers[3])] > 3000


def test_random_two_uses_both_candidates_distinctly() -> None:
    servers = make_servers(1, 1)
    servers[0].active = 1
    balancer = Balancer(servers, "random-two", rng=random.Random(8))
    # With two distinct candidates out of two, the idle one always wins.
    assert all(balancer.pick(None) is servers[1] for _ in range(100))


def test_random_two_single_eligible() -> None:
    servers = make_servers(1, 1)
    servers[0].healthy = False
    balancer = Balancer(servers, "random-two", rng=random.Random(9))
    assert all(balancer.pick(None) is servers[1] for _ in range(10))


# -- source ip ---------------------------------------------------------------------


def test_source_ip_sticks_per_client() -> None:
    servers = make_servers(1, 1, 1)
    balancer = Balancer(servers, "source-ip", clock=FakeClock())
    first = {ip: balancer.pick(ip) for ip in ("192.0.2.1", "192.0.2.2", "192.0.2.3")}
    assert len({id(s) for s in first.values()}) == 3  # round robin for newcomers
    for _ in range(5):
        for ip, server in first.items():
            assert balancer.pick(ip) is server


def test_source_ip_expires_after_timeout_since_last_use() -> None:
    clock = FakeClock()
    servers = make_servers(1, 1, 1)
    a, b, c = servers
    balancer = Balancer(servers, "source-ip", affinity_timeout=100.0, clock=clock)
    assert balancer.pick("192.0.2.1") is a
    # Used every 60 s: stays, because the timeout counts from the last use.
    for _ in range(5):
        clock.now += 60.0
        assert balancer.pick("192.0.2.1") is a
    assert balancer.pick("192.0.2.2") is b
    clock.now += 99.9
    assert balancer.pick("192.0.2.1") is a
    clock.now += 100.0
    assert balancer.pick("192.0.2.1") is c  # expired: picked afresh


def test_source_ip_purges_expired_entries() -> None:
    clock = FakeClock()
    balancer = Balancer(
        make_servers(1, 1), "source-ip", affinity_timeout=10.0, clock=clock
    )
    for i in range(100):
        balancer.pick(f"192.0.2.{i}")
    assert len(balancer._affinity) == 100
    clock.now += 10.0
    balancer.pick("198.51.100.1")
    assert list(balancer._affinity) == ["198.51.100.1"]


def test_source_ip_table_is_capped() -> None:
    balancer = Balancer(
        make_servers(1, 1), "source-ip", clock=FakeClock(), max_affinity_entries=3
    )
    for ip in ("192.0.2.1", "192.0.2.2", "192.0.2.3", "192.0.2.4"):
        balancer.pick(ip)
    assert list(balancer._affinity) == ["192.0.2.2", "192.0.2.3", "192.0.2.4"]


def test_source_ip_moves_when_unhealthy_or_excluded() -> None:
    servers = make_servers(1, 1, 1)
    balancer = Balancer(servers, "source-ip", clock=FakeClock())
    first = balancer.pick("192.0.2.1")
    assert first is not None
    first.healthy = False
    second = balancer.pick("192.0.2.1")
    assert second is not None
    assert second is not first
    first.healthy = True
    assert balancer.pick("192.0.2.1") is second  # the new choice is remembered
    third = balancer.pick("192.0.2.1", exclude={second})
    assert third is not None
    assert third is not second
    assert balancer.pick("192.0.2.1") is third


def test_source_ip_without_client_ip_is_round_robin() -> None:
    servers = make_servers(1, 1)
    balancer = Balancer(servers, "source-ip")
    assert names(servers, [balancer.pick(None) for _ in range(4)]) == "abab"
    assert not balancer._affinity


# -- set_servers -------------------------------------------------------------------


def test_set_servers_keeps_state_and_drops_removed() -> None:
    servers = make_servers(1, 1, 1)
    a, b, c = servers
    balancer = Balancer(servers, "source-ip", clock=FakeClock())
    assert balancer.pick("192.0.2.1") is a
    assert balancer.pick("192.0.2.2") is b
    d = Server(("10.0.0.9", 8080))
    balancer.set_servers([b, c, d])
    assert balancer.servers == (b, c, d)
    assert balancer.policy == "source-ip"
    assert balancer.pick("192.0.2.2") is b  # unchanged server keeps its clients
    moved = balancer.pick("192.0.2.1")  # its server was removed
    assert moved in {b, c, d}
    assert balancer.pick("192.0.2.1") is moved
    balancer.set_servers([])
    assert balancer.pick("192.0.2.1") is None


def test_set_servers_keeps_round_robin_position() -> None:
    servers = make_servers(1, 1, 1)
    balancer = Balancer(servers)
    assert names(servers, [balancer.pick(None) for _ in range(2)]) == "ab"
    balancer.set_servers(list(servers))
    assert names(servers, [balancer.pick(None) for _ in range(4)]) == "cabc"


# -- property: never returns an unavailable, excluded or removed server ----------

IPS = [f"192.0.2.{i}" for i in range(4)]

operations = st.lists(
    st.one_of(
        st.tuples(
            st.just("pick"),
            st.sampled_from([None, *IPS]),
            st.sets(st.integers(0, 5), max_size=3),
        ),
        st.tuples(st.just("health"), st.integers(0, 5), st.booleans()),
        st.tuples(st.just("eject"), st.integers(0, 5), st.floats(0, 50)),
        st.tuples(st.just("active"), st.integers(0, 5), st.integers(0, 20)),
        st.tuples(st.just("weight"), st.integers(0, 5), st.integers(1, 10)),
        st.tuples(st.just("servers"), st.sets(st.integers(0, 5))),
        st.tuples(st.just("time"), st.floats(0, 200)),
    ),
    max_size=60,
)


@given(
    policy=st.sampled_from(POLICIES),
    ops=operations,
    seed=st.integers(0, 2**32 - 1),
)
def test_balancer_never_picks_an_unavailable_server(
    policy: str, ops: list[tuple[object, ...]], seed: int
) -> None:
    clock = FakeClock()
    pool = make_servers(1, 2, 3, 1, 5, 1)
    current = pool[:3]
    balancer = Balancer(
        current,
        policy,
        affinity_timeout=100.0,
        rng=random.Random(seed),
        clock=clock,
        max_affinity_entries=3,
    )
    for op in ops:
        match op:
            case ("pick", ip, excluded):
                assert isinstance(excluded, set)
                exclude = {pool[i] for i in excluded}
                assert ip is None or isinstance(ip, str)
                got = balancer.pick(ip, exclude=exclude)
                candidates = [
                    s for s in current if s.is_available(clock.now) and s not in exclude
                ]
                if got is None:
                    assert not candidates
                else:
                    assert got in candidates
            case ("health", int(i), bool(healthy)):
                pool[i].healthy = healthy
                pool[i].down_until = None
            case ("eject", int(i), float(delay)):
                pool[i].healthy = False
                pool[i].down_until = clock.now + delay
            case ("active", int(i), int(active)):
                pool[i].active = active
            case ("weight", int(i), int(weight)):
                pool[i].weight = weight
            case ("servers", indices):
                assert isinstance(indices, set)
                current = [pool[i] for i in sorted(indices)]
                balancer.set_servers(current)
            case ("time", float(step)):
                clock.now += step
            case _:
                raise AssertionError(op)


# -- leases ------------------------------------------------------------------


def test_a_lease_counts_once_and_releases_once() -> None:
    server = Server(("127.0.0.1", 80))
    released: list[ServerLease] = []
    first = ServerLease(server, released.append)
    second = ServerLease(server)
    assert server.active == 2
    first.release()
    first.release()  # a second cleanup path gives nothing back twice
    assert server.active == 1
    assert released == [first]
    assert first.released
    assert not second.released
    second.release()
    assert server.active == 0
