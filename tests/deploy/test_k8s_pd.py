"""``deploy/k8s/pd/``: prefill/decode disaggregation on Kubernetes, checked as a cluster would
check it and against moeserve itself, with the helpers of ``test_k8s_manifests``.

What the pieces need to find each other:

- each instance is a StatefulSet pod with its own DNS name through a headless Service, and the
  router's ``--prefill``/``--decode`` URLs are exactly those names, one per replica (the router
  hands the prefill URL's host to the decode side as ``bootstrap_host``);
- each instance advertises its pod IP (``--disaggregation-host=$(POD_IP)``) to Mooncake;
- the container args parse with moeserve's own CLI into an engine of the right role on one
  host, and into the options ``moeserve router`` would run with.
"""

from __future__ import annotations

import logging
import re

import pytest
import yaml

from moeserve.cli import engine_kwargs
from moeserve.cli_pd import disaggregation_kwargs
from moeserve.config import EngineConfig
from moeserve.serving import router as router_mod
from moeserve.serving.api_server import PUBLIC_PATHS
from moeserve.serving.router import RouterOptions
from tests.deploy.test_k8s_manifests import DOCS as K8S_DOCS
from tests.deploy.test_k8s_manifests import (
    K8S_DIR,
    KUBERNETES_VERSIONS,
    _break,
    cli_args,
    container,
    named_ports,
    naming_errors,
    only,
    schema_errors,
    selects,
    serve_args,
)

PD_DIR = K8S_DIR / "pd"
ROLES = ("prefill", "decode")
ROUTER = "moeserve-router"
PROBES = ("startupProbe", "readinessProbe", "livenessProbe")


def _load_documents() -> dict[str, dict]:
    docs = {}
    for path in sorted(PD_DIR.glob("*.y*ml")):
        for i, doc in enumerate(yaml.safe_load_all(path.read_text())):
            if doc is not None:
                docs[f"{path.relative_to(K8S_DIR)}#{i}"] = doc
    return docs


DOCS = _load_documents()


def pd(kind: str, name: str) -> dict:
    found = [d for d in DOCS.values() if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind} {name} in deploy/k8s/pd, found {len(found)}"
    return found[0]


def statefulset(role: str) -> dict:
    return pd("StatefulSet", f"moeserve-{role}")


def instance_template(role: str) -> dict:
    return statefulset(role)["spec"]["template"]


def router_template() -> dict:
    return pd("Deployment", ROUTER)["spec"]["template"]


def instance_args(role: str):
    return serve_args(container(instance_template(role)))


def pod_urls(role: str) -> tuple[str, ...]:
    """Each pod of the role's StatefulSet by its own name: <sts>-<i>.<serviceName>:<http>."""
    sts = statefulset(role)
    name, spec = sts["metadata"]["name"], sts["spec"]
    port = named_ports(container(spec["template"]))["http"]
    return tuple(f"http://{name}-{i}.{spec['serviceName']}:{port}" for i in range(spec["replicas"]))


def router_options(monkeypatch) -> RouterOptions:
    """The router container's args through ``moeserve router``'s own parser and command, up to
    the options it would run with (run_router replaced: nothing starts)."""
    args = cli_args(container(router_template()), "router")
    ran: list[RouterOptions] = []
    monkeypatch.setattr(router_mod, "run_router", ran.append)
    logger = logging.getLogger("moeserve")
    level = logger.level
    try:
        args.func(args)  # cmd_router: builds RouterOptions, which validates them
    finally:
        logger.setLevel(level)
    (options,) = ran
    return options


def pre_stop_s(c: dict) -> int:
    return c.get("lifecycle", {}).get("preStop", {}).get("sleep", {}).get("seconds", 0)


def startup_budget_s(c: dict) -> int:
    probe = c["startupProbe"]
    return probe["periodSeconds"] * probe["failureThreshold"]


# ---- schemas ------------------------------------------------------------------------------------


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("where", sorted(DOCS))
def test_every_document_passes_its_schema(where, version):
    assert schema_errors(DOCS[where], version) == [], where


def test_the_manifests_are_all_there():
    """Two instance roles with their headless Services, the router and its Service."""
    assert sorted((d["kind"], d["metadata"]["name"]) for d in DOCS.values()) == [
        ("Deployment", "moeserve-router"),
        ("Service", "moeserve-decode"),
        ("Service", "moeserve-pd"),
        ("Service", "moeserve-prefill"),
        ("StatefulSet", "moeserve-decode"),
        ("StatefulSet", "moeserve-prefill"),
    ]


PREFILL_CONTAINER = "spec.template.spec.containers.0"


@pytest.mark.parametrize(
    ("kind", "path", "value"),
    [
        ("StatefulSet", "spec.replicas", "two"),
        ("StatefulSet", "spec.serviceNam", "moeserve-prefill"),  # misspelt field
        ("StatefulSet", f"{PREFILL_CONTAINER}.env.0.valueFrom.fieldRef.fieldPaht", "x"),
        ("StatefulSet", f"{PREFILL_CONTAINER}.ports.1.containerPort", "8998"),
        ("Service", "spec.publishNotReadyAddresses", "true"),
        ("Deployment", "spec.template.spec.containers.0.args.2", 8000),  # unquoted number
    ],
)
def test_a_broken_manifest_is_caught(kind, path, value):
    doc = next(d for d in DOCS.values() if d["kind"] == kind)
    assert schema_errors(doc, KUBERNETES_VERSIONS[-1]) == []
    assert schema_errors(_break(doc, path, value), KUBERNETES_VERSIONS[-1]) != []


# ---- the instances ------------------------------------------------------------------------------


@pytest.mark.parametrize("role", ROLES)
def test_an_instance_is_one_engine_of_its_role_on_one_host(role):
    """The args build the engine `moeserve serve` would: a wrong flag, a wildcard address
    without --disaggregation-host, or a group over several hosts (refused in PD mode) fails."""
    args = instance_args(role)
    assert args.disaggregation_mode == role
    config = EngineConfig(**engine_kwargs(args), **disaggregation_kwargs(args))
    assert config.disaggregation_options.mode == role
    assert config.nnodes == 1


@pytest.mark.parametrize("role", ROLES)
def test_an_instance_advertises_its_pod_ip(role):
    """Mooncake and the bootstrap socket advertise --disaggregation-host: the pod's IP, which
    Kubernetes expands from POD_IP (the downward API) only if the container defines it."""
    c = container(instance_template(role))
    assert instance_args(role).disaggregation_host == "$(POD_IP)"
    (pod_ip,) = [e for e in c["env"] if e["name"] == "POD_IP"]
    assert pod_ip["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}


@pytest.mark.parametrize("role", ROLES)
def test_the_api_listens_where_the_probes_and_the_router_look(role):
    c = container(instance_template(role))
    args = instance_args(role)
    assert args.host in ("0.0.0.0", "::"), "the API must listen beyond the pod's loopback"
    assert named_ports(c)["http"] == args.port == 8000
    for probe in PROBES:
        assert c[probe]["httpGet"] == {"path": "/health", "port": "http"}, probe


def test_the_prefill_exposes_the_bootstrap_port_it_binds():
    """Decode instances connect to the prefill pod on --disaggregation-bootstrap-port."""
    c = container(instance_template("prefill"))
    assert named_ports(c)["bootstrap"] == instance_args("prefill").disaggregation_bootstrap_port
    service = pd("Service", statefulset("prefill")["spec"]["serviceName"])
    assert {p["targetPort"] for p in service["spec"]["ports"]} == {"http", "bootstrap"}


@pytest.mark.parametrize("role", ROLES)
def test_instances_have_no_api_key_the_router_cannot_send(role):
    """`moeserve router` asks each instance's /server_info (and sglang-router its /model_info)
    without a key: a keyed instance answers 401 and the router never starts."""
    c = container(instance_template(role))
    keyed = instance_args(role).api_key is not None or "MOESERVE_API_KEY" in {
        e["name"] for e in c.get("env", [])
    }
    registrable = {"/server_info", "/model_info"} <= set(PUBLIC_PATHS)
    assert not keyed or registrable


@pytest.mark.parametrize("role", ROLES)
def test_each_statefulset_is_named_by_its_headless_service(role):
    """serviceName must be a headless Service over this role's pods only: the pods' DNS names
    <sts>-<i>.<serviceName> exist only then, and resolve while not ready (the router decides
    itself which instance is healthy)."""
    spec = statefulset(role)["spec"]
    service = pd("Service", spec["serviceName"])["spec"]
    assert service["clusterIP"] == "None"
    assert service["publishNotReadyAddresses"] is True
    labels = spec["template"]["metadata"]["labels"]
    assert selects(spec["selector"]["matchLabels"], labels)
    assert selects(service["selector"], labels)
    others = [instance_template(r)["metadata"]["labels"] for r in ROLES if r != role]
    others.append(router_template()["metadata"]["labels"])
    assert not any(selects(service["selector"], o) for o in others)


@pytest.mark.parametrize("role", ROLES)
def test_one_instance_pod_per_host(role):
    """Each instance sizes itself to its host; the router may go anywhere."""
    affinity = instance_template(role)["spec"]["affinity"]["podAntiAffinity"]
    (term,) = affinity["requiredDuringSchedulingIgnoredDuringExecution"]
    assert term["topologyKey"] == "kubernetes.io/hostname"
    avoided = term["labelSelector"]["matchLabels"]
    assert all(selects(avoided, instance_template(r)["metadata"]["labels"]) for r in ROLES)
    assert not selects(avoided, router_template()["metadata"]["labels"])


@pytest.mark.parametrize("role", ROLES)
def test_instances_are_guaranteed_whole_cpus(role):
    """requests == limits with whole CPUs: Guaranteed QoS, so that the static CPU manager hands
    out whole cores for moeserve to pin its ranks to."""
    resources = container(instance_template(role))["resources"]
    assert resources["requests"] == resources["limits"]
    assert re.fullmatch(r"[1-9][0-9]*", str(resources["requests"]["cpu"]))


@pytest.mark.parametrize("role", ROLES)
def test_the_grace_period_covers_the_drain(role):
    c, spec = container(instance_template(role)), instance_template(role)["spec"]
    drain = instance_args(role).shutdown_timeout
    assert spec["terminationGracePeriodSeconds"] >= pre_stop_s(c) + drain + 10


# ---- the router ---------------------------------------------------------------------------------


def test_the_router_lists_every_instance_pod_by_name(monkeypatch):
    """One URL per StatefulSet pod, by the pod's own name: changing replicas without the
    router's args (or a Service's name without the URLs) fails here."""
    options = router_options(monkeypatch)
    assert options.prefill_urls == pod_urls("prefill")
    assert options.decode_urls == pod_urls("decode")


def test_the_router_listens_where_its_probes_and_service_look(monkeypatch):
    """sglang-router 0.3.2 answers /health 200 as soon as it listens and /readiness 503 until
    it has healthy workers; nothing listens before every instance answered, so the startup
    probe waits as long as the router waits for the instances, and that as long as the
    instances may take to load."""
    options = router_options(monkeypatch)
    c = container(router_template())
    assert options.host in ("0.0.0.0", "::")
    assert named_ports(c)["http"] == options.port
    assert named_ports(c)["metrics"] == options.metrics_port
    assert c["startupProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert c["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert c["readinessProbe"]["httpGet"] == {"path": "/readiness", "port": "http"}
    assert startup_budget_s(c) >= options.wait_timeout_s
    for role in ROLES:
        assert options.wait_timeout_s >= startup_budget_s(container(instance_template(role)))


def test_the_routers_grace_period_covers_its_stop():
    """preStop, then SIGTERM: moeserve router forwards it and kills sglang-router after
    _STOP_WAIT_S."""
    c, spec = container(router_template()), router_template()["spec"]
    assert spec["terminationGracePeriodSeconds"] >= pre_stop_s(c) + router_mod._STOP_WAIT_S + 5


def test_the_pd_service_selects_the_router_pods_only():
    service = pd("Service", "moeserve-pd")["spec"]
    deployment = pd("Deployment", ROUTER)["spec"]
    labels = deployment["template"]["metadata"]["labels"]
    assert selects(deployment["selector"]["matchLabels"], labels)
    assert selects(service["selector"], labels)
    for role in ROLES:
        assert not selects(service["selector"], instance_template(role)["metadata"]["labels"])
    (port,) = service["ports"]
    assert port["targetPort"] in named_ports(container(router_template()))


# ---- alongside deploy/k8s -----------------------------------------------------------------------


def _pd_pod_labels() -> list[dict[str, str]]:
    labels = [instance_template(r)["metadata"]["labels"] for r in ROLES]
    return labels + [router_template()["metadata"]["labels"]]


def test_no_service_of_deploy_k8s_selects_a_pd_pod():
    """The LWS leaders' and the one-host Deployment's Services must not send their clients to
    a prefill, decode or router pod."""
    for service in (d for d in K8S_DOCS.values() if d["kind"] == "Service"):
        selector = service["spec"]["selector"]
        assert not any(selects(selector, pod) for pod in _pd_pod_labels()), service

    # and the PD Services select none of deploy/k8s's pods
    other_pods = [
        d["spec"]["template"]["metadata"]["labels"]
        for d in K8S_DOCS.values()
        if d["kind"] == "Deployment"
    ]
    for service in (d for d in DOCS.values() if d["kind"] == "Service"):
        assert not any(selects(service["spec"]["selector"], pod) for pod in other_pods)


def test_the_podmonitor_scrapes_the_instances_not_the_router():
    """The router's :8000 has no moeserve /metrics (sglang-router's own are on :8001)."""
    monitor = only("PodMonitor")["spec"]
    (endpoint,) = monitor["podMetricsEndpoints"]
    for role in ROLES:
        template = instance_template(role)
        assert selects(monitor["selector"]["matchLabels"], template["metadata"]["labels"])
        assert endpoint["port"] in named_ports(container(template))
    assert not selects(monitor["selector"]["matchLabels"], router_template()["metadata"]["labels"])


@pytest.mark.parametrize("template", [*ROLES, "router"])
def test_no_service_variables_reach_moeserve(template):
    spec = (router_template() if template == "router" else instance_template(template))["spec"]
    assert spec["enableServiceLinks"] is False


def test_names_pass_the_api_servers_own_checks():
    """What the schemas do not say: object names, pod names (hostnames), label values and
    port names."""
    pods = []
    for role in ROLES:
        sts = statefulset(role)
        pods += [f"{sts['metadata']['name']}-{i}" for i in range(sts["spec"]["replicas"])]
    templates = [instance_template(r) for r in ROLES] + [router_template()]
    assert naming_errors(DOCS.values(), templates, pods) == []
