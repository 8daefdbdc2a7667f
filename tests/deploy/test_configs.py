"""docker-compose.yml, deploy/nginx.conf and deploy/prometheus.yml agree with each other and
with the server's settings (no Docker engine runs here: this is the static half)."""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import urlsplit

import yaml

from kenspec.server.settings import FIELD_GROUPS, Settings, env_name

REPO = Path(__file__).resolve().parents[2]


def compose() -> dict:
    return yaml.safe_load((REPO / "docker-compose.yml").read_text())


def nginx_conf() -> str:
    return (REPO / "deploy" / "nginx.conf").read_text()


def prometheus() -> dict:
    return yaml.safe_load((REPO / "deploy" / "prometheus.yml").read_text())


def test_compose_services_and_mounts() -> None:
    services = compose()["services"]
    assert set(services) == {"kenspec", "nginx", "prometheus", "redis"}
    assert services["kenspec"]["deploy"]["replicas"] >= 2
    for name, config in (("nginx", "nginx.conf"), ("prometheus", "prometheus.yml")):
        mounts = services[name]["volumes"]
        assert any(m.startswith(f"./deploy/{config}:") for m in mounts)
        assert (REPO / "deploy" / config).is_file()
    assert services["nginx"]["depends_on"]["kenspec"]["condition"] == "service_healthy"


def test_environment_names_real_settings() -> None:
    known = {env_name(field) for field in FIELD_GROUPS}
    environment = compose()["services"]["kenspec"]["environment"]
    assert set(environment) <= known, set(environment) - known


def test_replicas_share_answers_through_an_unpublished_redis() -> None:
    """The replicas reach Redis by its service name on the port it exposes; nothing outside the
    compose network reaches it (no password), and it keeps nothing on disk."""
    services = compose()["services"]
    redis, kenspec = services["redis"], services["kenspec"]
    assert redis["image"] == "redis:7-alpine"
    assert "ports" not in redis  # published_ports_bind_to_loopback: not published at all
    url = urlsplit(kenspec["environment"]["KENSPEC_SHARE_ANSWERS"])
    assert (url.scheme, url.hostname, url.path) == ("redis", "redis", "/0")
    assert str(url.port) in [str(p) for p in redis["expose"]]
    command = redis["command"]
    assert isinstance(command, list)  # no shell quoting: --save "" is one empty argument
    assert command[0] == "redis-server"
    assert command[command.index("--save") + 1] == ""
    assert command[command.index("--appendonly") + 1] == "no"
    assert re.fullmatch(r"\d+mb", command[command.index("--maxmemory") + 1])
    assert command[command.index("--maxmemory-policy") + 1] == "allkeys-lru"
    # Started first, but a replica starts (and serves) without it.
    assert kenspec["depends_on"]["redis"] == {"condition": "service_started", "required": False}


def test_nginx_proxies_grpc_to_the_kenspec_port() -> None:
    text = nginx_conf()
    kenspec = compose()["services"]["kenspec"]
    grpc_port = kenspec["environment"]["KENSPEC_GRPC_PORT"]
    for upstream in ("kenspec_grpc", "kenspec_grpc_session"):
        assert re.search(rf"server\s+kenspec:{grpc_port};", upstream_block(text, upstream))
    assert re.search(r"grpc_pass\s+grpc://\$kenspec_grpc_pool;", text)
    listen = re.search(r"listen\s+(\d+)\s+http2;", text)
    assert listen is not None
    ports = [port for _, _, port in published({}) if port == listen.group(1)]
    assert ports == [listen.group(1)]
    assert grpc_port in [str(p) for p in kenspec["expose"]]
    # Long streams must not be cut by proxy timeouts.
    seconds = int(re.search(r"grpc_read_timeout\s+(\d+)s;", text).group(1))
    assert seconds >= 600


def test_nginx_proxies_the_http_api_unbuffered_to_the_kenspec_http_port() -> None:
    text = nginx_conf()
    kenspec = compose()["services"]["kenspec"]
    http_port = kenspec["environment"]["KENSPEC_PORT"]
    for upstream in ("kenspec_http", "kenspec_http_session"):
        assert re.search(rf"server\s+kenspec:{http_port};", upstream_block(text, upstream))
    assert re.search(r"proxy_pass\s+http://\$kenspec_http_pool;", text)
    assert re.search(r"proxy_buffering\s+off;", text)  # events as they come
    listen = re.search(r"listen\s+(\d+);", text)
    assert listen is not None
    ports = [port for _, _, port in published({}) if port == listen.group(1)]
    assert ports == [listen.group(1)]
    assert http_port in [str(p) for p in kenspec["expose"]]
    assert int(re.search(r"proxy_read_timeout\s+(\d+)s;", text).group(1)) >= 600
    # nginx must drop an idle upstream connection before the replica closes it (a request
    # sent on a connection the replica is closing fails), in both pools
    for upstream in ("kenspec_http", "kenspec_http_session"):
        idle = re.search(r"keepalive_timeout\s+(\d+)s;", upstream_block(text, upstream))
        assert idle is not None and int(idle.group(1)) < Settings().limits.http_keepalive_timeout_s


def upstream_block(text: str, name: str) -> str:
    """The body of nginx.conf's `upstream name { ... }`."""
    found = re.search(rf"upstream {name} \{{(.*?)\}}", text, re.S)
    assert found is not None, f"no upstream {name} in deploy/nginx.conf"
    return found.group(1)


def test_nginx_routes_sessions_by_hash_and_the_rest_by_least_connections() -> None:
    """A session key (X-Session-Id, gRPC x-session-id) picks the hashed pool, no key the
    least-connections pool, for both APIs; the workers share their counts (zone)."""
    text = nginx_conf()
    for api in ("grpc", "http"):
        pool = re.search(rf"map \$http_x_session_id \$kenspec_{api}_pool \{{(.*?)\}}", text, re.S)
        assert pool is not None
        assert re.findall(r'^\s*(""|default)\s+(\w+);$', pool.group(1), re.M) == [
            ('""', f"kenspec_{api}"),
            ("default", f"kenspec_{api}_session"),
        ]
        least = upstream_block(text, f"kenspec_{api}")
        session = upstream_block(text, f"kenspec_{api}_session")
        assert re.search(r"^\s*least_conn;", least, re.M)
        assert re.search(r"^\s*hash \$http_x_session_id;", session, re.M)
        assert all("zone " in block and "keepalive " in block for block in (least, session))


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
    assert "HEALTHCHECK" in text and "kenspec.server.healthcheck" in text
    # No address of its own: it finds the port and the TLS files in the server's KENSPEC_*.
    (command,) = re.findall(r"^\s+CMD \[(.*)\]$", text, re.MULTILINE)
    assert command == '"python", "-m", "kenspec.server.healthcheck"'
    assert "scripts/build_kenlm_tools.sh" in text and "scripts/fetch_default_model.py" in text
    for paths in re.findall(r"^COPY (?!--from)(.+) \S+$", text, re.MULTILINE):
        for path in paths.split():
            assert (REPO / path).exists(), f"Dockerfile copies {path}, which is not in the repo"


def dockerfile_stages() -> dict[str, str]:
    """Each `FROM ... AS name` stage of the Dockerfile, by name: its text."""
    text = (REPO / "Dockerfile").read_text()
    parts = re.split(r"^FROM \S+ AS (\w+)$", text, flags=re.MULTILINE)
    return dict(zip(parts[1::2], parts[2::2], strict=True))


def test_the_kernels_are_built_in_the_build_stage_and_the_runtime_has_no_compiler() -> None:
    """setup.py compiles the C kernels into the package when the build stage installs kenspec
    (required there); the runtime stage gets the installed venv, OpenMP's runtime for the
    kernels, and no compiler or C headers to build them at start-up."""
    stages = dockerfile_stages()
    assert list(stages) == ["build", "runtime"]
    build, runtime = stages["build"], stages["runtime"]
    assert re.search(r"^COPY .*\bsetup\.py\b", build, re.MULTILINE)
    assert re.search(r'KENSPEC_PREBUILD=require /opt/venv/bin/pip install [^\n]*"\.\[', build)
    assert re.search(r"\bbuild-essential\b", build)
    packages = " ".join(re.findall(r"apt-get install ([^&]*)", runtime)).split()
    assert "libgomp1" in packages
    compilers = {"gcc", "cc", "g++", "clang", "build-essential", "libc6-dev", "cpp"}
    assert not compilers & set(packages), compilers & set(packages)
    assert not re.search(r"\b(gcc|clang|build-essential|libc6-dev)\b", runtime)
    assert "COPY --from=build /opt/venv /opt/venv" in runtime


def interpolate(value: str, env: dict[str, str]) -> str:
    """Compose's ${NAME:-default} and ${NAME} in `value`, as `docker compose` expands them."""

    def one(match: re.Match) -> str:
        name, default = match.group(1), match.group(3) or ""
        return env.get(name) or default

    return re.sub(r"\$\{(\w+)(:-([^}]*))?\}", one, value)


def published(env: dict[str, str], *files: str) -> list[tuple[str, str, str]]:
    """(service, host address, host port) of every port the compose files publish."""
    found = []
    for name in ("docker-compose.yml", *files):
        for service, config in yaml.safe_load((REPO / name).read_text())["services"].items():
            for port in config.get("ports", []):
                # Short syntax only, HOST:PORT:PORT: without a host Docker publishes everywhere
                assert isinstance(port, str), f"{service}: {port!r} is not HOST:PORT:PORT"
                parts = interpolate(port, env).rsplit(":", 2)
                assert len(parts) == 3, f"{service} publishes {port!r} without a host address"
                found.append((service, parts[0].strip("[]"), parts[1]))
    return found


def test_published_ports_bind_to_loopback_unless_told_otherwise() -> None:
    ports = published({}, "deploy/compose.tokens.yml")
    assert {(s, p) for s, _, p in ports} == {
        ("nginx", "8080"),
        ("nginx", "8000"),
        ("prometheus", "9090"),
    }
    assert all(host == "127.0.0.1" for _, host, _ in ports), ports
    everywhere = published({"KENSPEC_BIND": "0.0.0.0"})
    assert all(host == "0.0.0.0" for _, host, _ in everywhere), everywhere


def test_replicas_publish_nothing_and_prometheus_reaches_their_metrics() -> None:
    """The metrics listen on loopback by default; the compose network needs them on every
    interface of the replica's container, which publishes none of its ports."""
    kenspec = compose()["services"]["kenspec"]
    assert "ports" not in kenspec
    assert kenspec["environment"]["KENSPEC_METRICS_HOST"] == "0.0.0.0"
    assert Settings().server.metrics_host == "127.0.0.1"


def test_the_tokens_overlay_gives_replicas_and_prometheus_one_secret() -> None:
    overlay = yaml.safe_load((REPO / "deploy" / "compose.tokens.yml").read_text())
    services = overlay["services"]
    (secret,) = overlay["secrets"]
    assert overlay["secrets"][secret]["file"].startswith("./deploy/secrets/")
    mounted = f"/run/secrets/{secret}"
    known = {env_name(field) for field in FIELD_GROUPS}
    assert set(services["kenspec"]["environment"]) <= known
    assert services["kenspec"]["environment"]["KENSPEC_AUTH_TOKENS_FILE"] == mounted
    assert "KENSPEC_METRICS_AUTH" not in services["kenspec"]["environment"]  # auto: token
    assert services["kenspec"]["secrets"] == services["prometheus"]["secrets"] == [secret]
    # Prometheus reads the overlay's config in place of the base one (same mount target).
    (mount,) = services["prometheus"]["volumes"]
    source, target, _ = mount.split(":")
    (base,) = compose()["services"]["prometheus"]["volumes"]
    assert target == base.split(":")[1]
    tokens = yaml.safe_load((REPO / source).read_text())
    (job,) = tokens["scrape_configs"]
    assert job.pop("authorization") == {"credentials_file": mounted}
    assert tokens == prometheus()  # otherwise the base config, as it is
    assert (REPO / ".gitignore").read_text().count("/deploy/secrets/") == 1
