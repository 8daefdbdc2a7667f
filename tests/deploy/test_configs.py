"""docker-compose.yml, deploy/nginx.conf and deploy/prometheus.yml agree with each other and
with the server's settings (no Docker engine runs here: this is the static half)."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from server.settings import Settings, env_name

REPO = Path(__file__).resolve().parents[2]


def compose() -> dict:
    return yaml.safe_load((REPO / "docker-compose.yml").read_text())


def nginx_conf() -> str:
    return (REPO / "deploy" / "nginx.conf").read_text()


def prometheus() -> dict:
    return yaml.safe_load((REPO / "deploy" / "prometheus.yml").read_text())


def test_compose_services_and_mounts() -> None:
    services = compose()["services"]
    assert set(services) == {"kenspec", "nginx", "prometheus"}
    assert services["kenspec"]["deploy"]["replicas"] >= 2
    for name, config in (("nginx", "nginx.conf"), ("prometheus", "prometheus.yml")):
        mounts = services[name]["volumes"]
        assert any(m.startswith(f"./deploy/{config}:") for m in mounts)
        assert (REPO / "deploy" / config).is_file()
    assert services["nginx"]["depends_on"]["kenspec"]["condition"] == "service_healthy"


def test_environment_names_real_settings() -> None:
    known = {env_name(field) for field in Settings.__dataclass_fields__}
    environment = compose()["services"]["kenspec"]["environment"]
    assert set(environment) <= known, set(environment) - known


def test_nginx_proxies_grpc_to_the_kenspec_port() -> None:
    text = nginx_conf()
    kenspec = compose()["services"]["kenspec"]
    grpc_port = kenspec["environment"]["KENSPEC_PORT"]
    assert re.search(rf"server\s+kenspec:{grpc_port};", text)
    assert re.search(r"grpc_pass\s+grpc://kenspec_grpc;", text)
    listen = re.search(r"listen\s+(\d+)\s+http2;", text)
    assert listen is not None
    published = compose()["services"]["nginx"]["ports"]
    assert f"{listen.group(1)}:{listen.group(1)}" in published
    assert grpc_port in [str(p) for p in kenspec["expose"]]
    # Long streams must not be cut by proxy timeouts.
    seconds = int(re.search(r"grpc_read_timeout\s+(\d+)s;", text).group(1))
    assert seconds >= 600


def test_nginx_proxies_the_http_api_unbuffered_to_the_kenspec_http_port() -> None:
    text = nginx_conf()
    kenspec = compose()["services"]["kenspec"]
    http_port = kenspec["environment"]["KENSPEC_HTTP_PORT"]
    assert re.search(rf"server\s+kenspec:{http_port};", text)
    assert re.search(r"proxy_pass\s+http://kenspec_http;", text)
    assert re.search(r"proxy_buffering\s+off;", text)  # events as they come
    listen = re.search(r"listen\s+(\d+);", text)
    assert listen is not None
    published = compose()["services"]["nginx"]["ports"]
    assert f"{listen.group(1)}:{listen.group(1)}" in published
    assert http_port in [str(p) for p in kenspec["expose"]]
    assert int(re.search(r"proxy_read_timeout\s+(\d+)s;", text).group(1)) >= 600


def test_prometheus_scrapes_every_replica_on_the_metrics_port() -> None:
    jobs = prometheus()["scrape_configs"]
    kenspec = compose()["services"]["kenspec"]
    metrics_port = int(kenspec["environment"]["KENSPEC_METRICS_PORT"])
    (job,) = [j for j in jobs if j["job_name"] == "kenspec"]
    (discovery,) = job["dns_sd_configs"]
    assert discovery["names"] == ["kenspec"] and discovery["type"] == "A"
    assert discovery["port"] == metrics_port
    assert str(metrics_port) in [str(p) for p in kenspec["expose"]]


def test_dockerfile_runs_as_non_root_with_a_grpc_health_check() -> None:
    text = (REPO / "Dockerfile").read_text()
    assert text.count("FROM ") >= 2  # multi-stage
    assert re.search(r"^USER kenspec$", text, re.MULTILINE)
    assert "HEALTHCHECK" in text and "server.healthcheck" in text
    # No address of its own: it finds the port and the TLS files in the server's KENSPEC_*.
    (command,) = re.findall(r"^\s+CMD \[(.*)\]$", text, re.MULTILINE)
    assert command == '"python", "-m", "server.healthcheck"'
    assert "scripts/build_kenlm_tools.sh" in text and "scripts/fetch_default_model.py" in text
    for path in re.findall(r"^COPY (?!--from)(\S+) ", text, re.MULTILINE):
        assert (REPO / path).exists(), f"Dockerfile copies {path}, which is not in the repo"
