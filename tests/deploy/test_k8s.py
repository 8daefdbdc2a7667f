"""deploy/k8s/ is valid Kubernetes and agrees with the server's settings, the Dockerfile and
docker-compose.yml. No cluster runs here: every document is checked against the API's JSON
schemas (kubernetes-validate, offline, strict: an unknown or misplaced field is refused)."""

from __future__ import annotations

import copy
import re
from pathlib import Path
from urllib.parse import urlsplit

import kubernetes_validate
import pytest
import yaml

from kenspec.server.settings import FIELD_GROUPS, Settings, env_name, parse_settings

REPO = Path(__file__).resolve().parents[2]
MANIFESTS = sorted((REPO / "deploy" / "k8s").glob("*.yaml"))
# The version the README states, and the oldest the manifest needs (gRPC probes are GA in 1.27).
KUBERNETES_VERSIONS = ("1.30", "1.27")
PORTS = {"grpc": "grpc_port", "http": "port", "metrics": "metrics_port"}  # -> ServerSettings


def documents() -> list[dict]:
    found = []
    for path in MANIFESTS:
        found += [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]
    return found


def one(kind: str, name: str) -> dict:
    (found,) = [d for d in documents() if d["kind"] == kind and d["metadata"]["name"] == name]
    return found


def container(deployment: str) -> dict:
    (only,) = one("Deployment", deployment)["spec"]["template"]["spec"]["containers"]
    return only


def environment() -> dict[str, str]:
    return {item["name"]: item["value"] for item in container("kenspec")["env"]}


def compose() -> dict:
    return yaml.safe_load((REPO / "docker-compose.yml").read_text())["services"]


def test_there_are_manifests_of_every_kind_needed() -> None:
    kinds = {(d["kind"], d["metadata"]["name"]) for d in documents()}
    assert {
        ("Deployment", "kenspec"),
        ("Service", "kenspec"),
        ("Service", "kenspec-grpc"),
        ("Deployment", "redis"),
        ("Service", "redis"),
    } <= kinds


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_every_document_is_valid_kubernetes(version: str) -> None:
    refused = []  # the error's own report prints the whole schema: name the field instead
    for doc in documents():
        try:
            assert kubernetes_validate.validate(doc, version, strict=True) == version
        except kubernetes_validate.ValidationError as error:
            where = "/".join(str(part) for part in error.absolute_path)
            refused.append(f"{doc['kind']} {doc['metadata']['name']}: {where}: {error.message}")
    assert not refused, refused


def test_the_validator_refuses_what_a_cluster_would() -> None:
    """The check above can fail: a field in the wrong place and a wrong type are refused."""
    deployment = one("Deployment", "kenspec")
    misplaced = copy.deepcopy(deployment)
    misplaced["spec"]["template"]["spec"]["containers"][0]["grpc"] = {"port": 50051}
    mistyped = copy.deepcopy(deployment)
    mistyped["spec"]["replicas"] = "3"
    for broken in (misplaced, mistyped):
        with pytest.raises(kubernetes_validate.ValidationError):
            kubernetes_validate.validate(broken, KUBERNETES_VERSIONS[0], strict=True)


def test_probes_ask_the_grpc_health_service_on_the_servers_port() -> None:
    kenspec = container("kenspec")
    port = int(environment()[env_name("grpc_port")])
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert kenspec[probe]["grpc"] == {"port": port}, probe
    # The kubelet's gRPC probes speak plaintext: with TLS they would fail (exec the healthcheck).
    assert env_name("tls_cert") not in environment()
    startup = kenspec["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 120  # load + calibrate


def test_ports_and_environment_are_the_servers() -> None:
    env = environment()
    known = {env_name(field) for field in FIELD_GROUPS}
    assert set(env) <= known, set(env) - known
    settings = parse_settings([], env)  # every value parses as the server would read it
    ports = {p["name"]: p["containerPort"] for p in container("kenspec")["ports"]}
    assert ports == {name: getattr(settings.server, field) for name, field in PORTS.items()}
    assert settings.server.host == settings.server.metrics_host == "0.0.0.0"  # other pods: any


def test_the_replicas_run_as_compose_runs_them() -> None:
    deployment = one("Deployment", "kenspec")
    kenspec = compose()["kenspec"]
    assert deployment["spec"]["replicas"] == kenspec["deploy"]["replicas"]
    assert container("kenspec")["image"] == kenspec["image"]
    env = environment()
    for name, value in kenspec["environment"].items():
        assert env.get(name) == str(value), name


def test_shared_answers_go_to_the_redis_service() -> None:
    url = urlsplit(environment()["KENSPEC_SHARE_ANSWERS"])
    assert url.geturl() == compose()["kenspec"]["environment"]["KENSPEC_SHARE_ANSWERS"]
    assert url.scheme == "redis"
    service = one("Service", url.hostname)
    (port,) = service["spec"]["ports"]
    assert port["port"] == url.port
    redis = container(url.hostname)
    assert [p["name"] for p in redis["ports"]] == [port["targetPort"]]
    assert redis["image"] == compose()["redis"]["image"]
    assert ["redis-server", *redis["args"]] == compose()["redis"]["command"]
    # No persistence; its memory cap fits under the container's limit.
    args = redis["args"]
    assert args[args.index("--save") + 1] == "" and args[args.index("--appendonly") + 1] == "no"
    cap = args[args.index("--maxmemory") + 1]
    assert mebibytes(redis["resources"]["limits"]["memory"]) > mebibytes(cap)


def mebibytes(quantity: str) -> float:
    number, unit = re.fullmatch(r"(\d+)(Mi|Gi|mb|gb)", quantity).groups()
    return int(number) * {"Mi": 1, "Gi": 1024, "mb": 1e6 / 2**20, "gb": 1e9 / 2**20}[unit]


def test_services_reach_the_pods_on_their_named_ports() -> None:
    labels = one("Deployment", "kenspec")["spec"]["template"]["metadata"]["labels"]
    redis = one("Deployment", "redis")["spec"]["template"]["metadata"]["labels"]
    names = {p["name"]: p["containerPort"] for p in container("kenspec")["ports"]}
    cluster, headless = one("Service", "kenspec")["spec"], one("Service", "kenspec-grpc")["spec"]
    assert headless["clusterIP"] == "None" and "clusterIP" not in cluster
    for spec in (cluster, headless):
        assert spec["selector"].items() <= labels.items()
        assert not spec["selector"].items() <= redis.items()
        for port in spec["ports"]:
            assert names[port["targetPort"]] == port["port"], port
    assert {p["name"] for p in cluster["ports"]} == set(PORTS)
    assert "grpc" in {p["name"] for p in headless["ports"]}


def test_the_http_api_answers_to_the_service_names() -> None:
    """Without tokens the HTTP API refuses (421) a Host it does not know."""
    allowed = {name.strip() for name in environment()[env_name("allowed_hosts")].split(",")}
    for service in ("kenspec", "kenspec-grpc"):
        namespace = one("Service", service)["metadata"]["namespace"]
        fqdn = f"{service}.{namespace}.svc.cluster.local"
        assert {service, fqdn} <= allowed


def test_termination_waits_for_the_drain() -> None:
    pod = one("Deployment", "kenspec")["spec"]["template"]["spec"]
    grace = parse_settings([], environment()).server.grace_period_s
    assert grace == Settings().server.grace_period_s
    sleep = container("kenspec")["lifecycle"]["preStop"]["exec"]["command"]
    assert sleep[0] == "sleep"
    # preStop runs within the grace period; the drain follows it, then saving the costs.
    assert pod["terminationGracePeriodSeconds"] >= int(sleep[1]) + grace + 5


def test_runs_as_the_images_user_with_a_read_only_root() -> None:
    dockerfile = (REPO / "Dockerfile").read_text()
    uid = int(re.search(r"useradd --create-home --uid (\d+) kenspec", dockerfile).group(1))
    pod = one("Deployment", "kenspec")["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] == uid
    kenspec = container("kenspec")
    assert kenspec["securityContext"]["readOnlyRootFilesystem"] is True
    assert kenspec["securityContext"]["allowPrivilegeEscalation"] is False
    # The calibration cache is written under the user's home: onto an emptyDir there.
    cache = Path("/home/kenspec") / Settings().kernels.calibration_cache.removeprefix("~/")
    mounts = {m["mountPath"]: m["name"] for m in kenspec["volumeMounts"]}
    (mounted,) = [name for path, name in mounts.items() if cache.is_relative_to(path)]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert "emptyDir" in volumes[mounted]


def test_resources_fit_the_default_model() -> None:
    """About 1.05 GB resident once ready, plus the prefix cache as prompts fill it."""
    resources = container("kenspec")["resources"]
    prefix_cache = parse_settings([], environment()).limits.prefix_cache_mb
    assert prefix_cache > 0  # fixed: the automatic size reads the node's memory, not the limit
    assert mebibytes(resources["requests"]["memory"]) >= 1024
    assert mebibytes(resources["limits"]["memory"]) >= 1100 + prefix_cache
    threads = parse_settings([], environment()).kernels.threads
    assert float(resources["limits"]["cpu"]) >= threads


def test_only_the_replicas_reach_redis() -> None:
    policy = one("NetworkPolicy", "redis")["spec"]
    redis = one("Deployment", "redis")["spec"]["template"]["metadata"]["labels"]
    kenspec = one("Deployment", "kenspec")["spec"]["template"]["metadata"]["labels"]
    assert policy["podSelector"]["matchLabels"].items() <= redis.items()
    (rule,) = policy["ingress"]
    (source,) = rule["from"]
    assert source["podSelector"]["matchLabels"].items() <= kenspec.items()
    assert not source["podSelector"]["matchLabels"].items() <= redis.items()
