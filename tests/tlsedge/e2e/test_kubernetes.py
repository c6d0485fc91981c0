"""The manifests in examples/kubernetes: schema-valid (offline) and consistent.

``tlsedge check`` on the embedded configuration: test_examples.py.
"""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

import kubernetes_validate  # type: ignore[import-untyped]
import pytest
import yaml

from tlsedge._core.config import Config, load_config

FOLDER = Path(__file__).resolve().parents[3] / "examples" / "kubernetes"
# The oldest version the manifests target (the preStop sleep action is on by
# default from 1.30) and the newest schema the validator bundles.
KUBERNETES_VERSIONS = ("1.30", kubernetes_validate.utils.latest_version())


class NetworkUsedError(AssertionError):
    """The schema validator tried to reach the network."""


@pytest.fixture
def _no_network(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail loudly if anything opens a connection or resolves a name."""

    def refuse(*args: object, **kwargs: object) -> Any:
        raise NetworkUsedError(
            "kubernetes-validate tried to use the network; the schemas must come "
            f"from the installed package (args: {args!r})"
        )

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)


def documents() -> list[tuple[str, dict[str, Any]]]:
    return [
        (path.name, document)
        for path in sorted(FOLDER.glob("*.yaml"))
        for document in yaml.safe_load_all(path.read_text())
        if document
    ]


def resource(kind: str, name: str | None = None) -> dict[str, Any]:
    matches = [
        doc
        for _, doc in documents()
        if doc["kind"] == kind and name in {None, doc["metadata"]["name"]}
    ]
    assert len(matches) == 1, (kind, name, len(matches))
    return matches[0]


@pytest.fixture
def config(tmp_path: Path) -> Config:
    text = resource("ConfigMap", "tlsedge-config")["data"]["tlsedge.toml"]
    path = tmp_path / "tlsedge.toml"
    path.write_text(text)
    return load_config(path)


def test_every_kind_is_there() -> None:
    kinds = sorted((doc["kind"], doc["metadata"]["name"]) for _, doc in documents())
    assert kinds == [
        ("ConfigMap", "tlsedge-config"),
        ("Deployment", "tlsedge"),
        ("Namespace", "tlsedge"),
        ("Secret", "tlsedge-tls"),
        ("Service", "app-backends"),
        ("Service", "tlsedge"),
    ]
    for _, doc in documents():
        if doc["kind"] != "Namespace":
            assert doc["metadata"]["namespace"] == "tlsedge"


@pytest.mark.usefixtures("_no_network")
@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_manifests_match_the_kubernetes_schemas(version: str) -> None:
    for filename, document in documents():
        try:
            kubernetes_validate.validate(document, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            where = ".".join(str(part) for part in exc.path)
            pytest.fail(f"{filename}: {document['kind']}: {where}: {exc.message}")


@pytest.mark.usefixtures("_no_network")
def test_the_validator_rejects_a_broken_manifest() -> None:
    deployment = resource("Deployment")
    deployment["spec"]["template"]["spec"]["terminationGracePeriodSecond"] = 1
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSIONS[0], strict=True)


def test_config_matches_the_manifests(config: Config) -> None:
    (listener,) = config.listeners
    assert listener.mode == "tcp"
    assert listener.tls is not None
    # A TCP relay offers in ALPN what the backends speak: the application
    # the README describes serves HTTP/1.1, so an "h2" would break clients.
    assert listener.tls.alpn == ("http/1.1",)
    assert listener.proxy_protocol is not None
    assert config.edge.admin is not None

    pod = resource("Deployment")["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    ports = {port["name"]: port["containerPort"] for port in container["ports"]}
    assert ports == {"https": listener.bind.port, "admin": config.edge.admin.port}

    # Certificates come from the tls Secret, the config from the ConfigMap.
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["tls"]["secret"]["secretName"] == "tlsedge-tls"
    assert volumes["config"]["configMap"]["name"] == "tlsedge-config"
    assert container["args"] == ["run", f"{mounts['config']}/tlsedge.toml"]
    secret = resource("Secret", "tlsedge-tls")
    assert secret["type"] == "kubernetes.io/tls"
    for certificate in listener.tls.certificates:
        assert certificate.cert == Path(mounts["tls"]) / "tls.crt"
        assert certificate.key == Path(mounts["tls"]) / "tls.key"
    assert "BEGIN" not in str(secret)  # a placeholder, never a real key

    # Probes on the admin endpoint.
    assert container["readinessProbe"]["httpGet"] == {
        "path": "/readyz",
        "port": "admin",
    }
    assert container["livenessProbe"]["httpGet"] == {
        "path": "/healthz",
        "port": "admin",
    }

    # Shutdown: preStop, then drain_timeout, all within the grace period.
    sleep = container["lifecycle"]["preStop"]["sleep"]["seconds"]
    grace = pod["terminationGracePeriodSeconds"]
    assert grace > config.edge.drain_timeout
    assert grace > sleep + config.edge.drain_timeout

    # Locked down.
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert container["resources"]["requests"]
    assert container["resources"]["limits"]


def test_load_balancer_service(config: Config) -> None:
    service = resource("Service", "tlsedge")
    spec, annotations = service["spec"], service["metadata"]["annotations"]
    assert spec["type"] == "LoadBalancer"
    assert spec["externalTrafficPolicy"] == "Local"
    (port,) = spec["ports"]
    assert port["targetPort"] == "https"
    prefix = "service.beta.kubernetes.io/aws-load-balancer-"
    assert annotations[prefix + "type"] == "nlb"
    assert annotations[prefix + "proxy-protocol"] == "*"
    assert annotations[prefix + "connection-draining-enabled"] == "true"
    draining = int(annotations[prefix + "connection-draining-timeout"])
    attributes = dict(
        item.split("=", 1)
        for item in annotations[prefix + "target-group-attributes"].split(",")
    )
    assert attributes["proxy_protocol_v2.enabled"] == "true"
    assert int(attributes["deregistration_delay.timeout_seconds"]) == draining
    idle = int(annotations[prefix + "connection-idle-timeout"])
    (listener,) = config.listeners
    assert listener.idle_timeout > idle  # the load balancer closes idle ones first
    assert listener.proxy_protocol is not None
    assert listener.proxy_protocol.versions == {1, 2}  # CLB v1, NLB v2
    pod = resource("Deployment")["spec"]["template"]
    assert spec["selector"].items() <= pod["metadata"]["labels"].items()


def test_headless_service_feeds_discovery(config: Config) -> None:
    service = resource("Service", "app-backends")
    assert service["spec"]["clusterIP"] == "None"
    (port,) = service["spec"]["ports"]
    (backend,) = config.backends
    assert backend.servers == ()
    discovery = backend.discovery
    assert discovery is not None
    namespace = service["metadata"]["namespace"]
    assert discovery.name == f"app-backends.{namespace}.svc.cluster.local."
    assert discovery.type == "A"
    assert discovery.port == port["port"]
    assert discovery.nameserver is None  # the pod's resolver: cluster DNS


def test_readme_applies_every_file() -> None:
    readme = (FOLDER / "README.md").read_text()
    for path in FOLDER.glob("*.yaml"):
        assert path.name in readme, path.name
