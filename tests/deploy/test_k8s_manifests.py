"""``deploy/k8s`` checked as a cluster would check it, and against moeserve itself.

Schemas: every document of every YAML file is validated strictly (unknown fields rejected, as
``kubectl apply`` does by default): the core kinds by ``kubernetes-validate`` against the
Kubernetes versions in :data:`KUBERNETES_VERSIONS`, the custom kinds (LeaderWorkerSet,
PodMonitor) against the ``openAPIV3Schema`` of their CRDs in ``tests/deploy/schemas``.

Consistency: the Services select the pods meant for them, the probes and the PodMonitor use
the API's named port, the container arguments parse with moeserve's own CLI, and the variables
LeaderWorkerSet injects map, through ``moeserve.launch.lws``, to node ranks 0..size-1 that
plan every rank of the world once.
"""

from __future__ import annotations

import copy
import re
from functools import cache
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from moeserve.cli import build_parser, engine_kwargs
from moeserve.config import EngineConfig
from moeserve.launch.lws import apply_lws
from moeserve.launch.spec import plan_local_ranks
from moeserve.serving.launcher import ServeOptions

K8S_DIR = Path(__file__).resolve().parents[2] / "deploy" / "k8s"
SCHEMAS = Path(__file__).with_name("schemas")
# oldest and newest checked; kubernetes-validate 1.37 ships 1.25-1.37 (lifecycle.preStop.sleep,
# used here, is on by default from 1.30)
KUBERNETES_VERSIONS = ("1.31", "1.37")
CRDS = {
    ("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet"): "leaderworkerset.x-k8s.io_leaderworkersets",
    ("monitoring.coreos.com/v1", "PodMonitor"): "monitoring.coreos.com_podmonitors",
}
LWS = "leaderworkerset.sigs.k8s.io"
TOPOLOGY_FLAGS = ("nnodes", "node_rank", "master_addr", "master_port")
_Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def _load_documents() -> dict[str, dict]:
    docs = {}
    # the top-level files only: deploy/k8s/pd/ is checked by test_k8s_pd.py
    for path in sorted(K8S_DIR.glob("*.y*ml")):
        for i, doc in enumerate(yaml.load_all(path.read_text(), Loader=_Loader)):
            if doc is not None:
                docs[f"{path.relative_to(K8S_DIR)}#{i}"] = doc
    return docs


DOCS = _load_documents()


def only(kind: str, name: str | None = None) -> dict:
    found = [
        d for d in DOCS.values() if d["kind"] == kind and name in (None, d["metadata"]["name"])
    ]
    assert len(found) == 1, f"expected one {kind} {name or ''} in deploy/k8s, found {len(found)}"
    return found[0]


# ---- schemas ------------------------------------------------------------------------------------


def _strict(node: dict) -> dict:
    """A CRD schema node as the API server applies it with strict field validation: objects
    that list their properties reject others (unless they preserve unknown fields), and
    ``nullable`` admits null."""
    out = dict(node)
    if "properties" in node:
        out["properties"] = {k: _strict(v) for k, v in node["properties"].items()}
        if "additionalProperties" not in node and not node.get(
            "x-kubernetes-preserve-unknown-fields"
        ):
            out["additionalProperties"] = False
    for key in ("items", "additionalProperties", "not"):
        if isinstance(node.get(key), dict):
            out[key] = _strict(node[key])
    for key in ("allOf", "anyOf", "oneOf"):
        if key in node:
            out[key] = [_strict(s) for s in node[key]]
    if node.get("nullable") and "type" in node:
        out["type"] = [node["type"], "null"]
    return out


@cache
def crd_validator(api_version: str, kind: str) -> jsonschema.Draft4Validator:
    crd = yaml.load((SCHEMAS / f"{CRDS[api_version, kind]}.yaml").read_text(), Loader=_Loader)
    assert crd["spec"]["names"]["kind"] == kind
    group, version = api_version.split("/")
    assert crd["spec"]["group"] == group
    (entry,) = [v for v in crd["spec"]["versions"] if v["name"] == version and v["served"]]
    # OpenAPI 3.0 schemas are closest to draft 4 (boolean exclusiveMinimum, one-schema items)
    return jsonschema.Draft4Validator(_strict(entry["schema"]["openAPIV3Schema"]))


def _path(error: jsonschema.ValidationError) -> str:
    return ".".join(str(p) for p in error.absolute_path) or "(root)"


def schema_errors(doc: dict, version: str) -> list[str]:
    """What the API server of Kubernetes ``version`` (with the CRDs installed) would reject."""
    key = (doc.get("apiVersion"), doc.get("kind"))
    if key in CRDS:
        errors = [f"{_path(e)}: {e.message}" for e in crd_validator(*key).iter_errors(doc)]
        # a custom resource's metadata is an ObjectMeta: check it as a ConfigMap's
        meta = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": doc.get("metadata", {})}
        return errors + schema_errors(meta, version)
    try:
        kubernetes_validate.validate(doc, version, strict=True)
    except kubernetes_validate.ValidationError as e:
        return [f"{_path(e)}: {e.message}"]
    except kubernetes_validate.SchemaNotFoundError as e:
        return [f"{e.message}: add its CRD to tests/deploy/schemas and to CRDS"]
    return []


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("where", sorted(DOCS))
def test_every_document_passes_its_schema(where, version):
    assert schema_errors(DOCS[where], version) == [], where


def test_the_manifests_are_all_there():
    kinds = sorted(d["kind"] for d in DOCS.values())
    assert kinds == ["Deployment", "LeaderWorkerSet", "PodMonitor", "Service", "Service"]


def _break(doc: dict, path: str, value) -> dict:
    """A copy of ``doc`` with ``value`` at ``path`` (dotted; integers index lists)."""
    broken = copy.deepcopy(doc)
    *parents, last = [int(p) if p.isdigit() else p for p in path.split(".")]
    node = broken
    for p in parents:
        node = node[p]
    node[last] = value
    return broken


LEADER_CONTAINER = "spec.leaderWorkerTemplate.leaderTemplate.spec.containers.0"
WORKER_CONTAINER = "spec.leaderWorkerTemplate.workerTemplate.spec.containers.0"


@pytest.mark.parametrize(
    ("kind", "path", "value"),
    [
        ("Deployment", "spec.replicas", "two"),
        ("Deployment", "spec.template.spec.containers.0.args.2", 2),  # unquoted number
        ("Deployment", "spec.template.spec.containers.0.resourcez", {}),  # misspelt field
        ("Service", "spec.ports.0.port", "http"),
        ("LeaderWorkerSet", "spec.leaderWorkerTemplate.restartPolicy", "RecreateGroup"),
        ("LeaderWorkerSet", "spec.leaderWorkerTemplate.size", "2"),
        ("LeaderWorkerSet", f"{LEADER_CONTAINER}.readinessProbe.httpGet.paht", "/health"),
        ("LeaderWorkerSet", f"{WORKER_CONTAINER}.env.0.valeu", "29500"),
        ("LeaderWorkerSet", "metadata.labels", {"app.kubernetes.io/name": 1}),
        ("PodMonitor", "spec.podMetricsEndpoints.0.interval", "15 seconds"),
        ("PodMonitor", "spec.selectr", {}),
    ],
)
def test_a_broken_manifest_is_caught(kind, path, value):
    doc = next(d for d in DOCS.values() if d["kind"] == kind)
    assert schema_errors(doc, KUBERNETES_VERSIONS[-1]) == []
    assert schema_errors(_break(doc, path, value), KUBERNETES_VERSIONS[-1]) != []


# ---- the pods as their controllers create them --------------------------------------------------


def pod_templates() -> list[tuple[str, dict]]:
    """(role, pod template) for every pod kind: leader and worker of the LWS, the Deployment's."""
    lws = only("LeaderWorkerSet")["spec"]["leaderWorkerTemplate"]
    server = only("Deployment")["spec"]["template"]
    return [
        ("leader", lws["leaderTemplate"]),
        ("worker", lws["workerTemplate"]),
        ("server", server),
    ]


def lws_pods() -> list[tuple[dict, dict]]:
    """(labels, injected env) of each pod of group 0, as the LWS controller makes them."""
    lws = only("LeaderWorkerSet")
    name, size = lws["metadata"]["name"], lws["spec"]["leaderWorkerTemplate"]["size"]
    templates = dict(pod_templates())
    pods = []
    for index in range(size):
        template = templates["leader" if index == 0 else "worker"]
        labels = dict(template["metadata"]["labels"])
        labels.update({f"{LWS}/name": name, f"{LWS}/group-index": "0"})
        labels[f"{LWS}/worker-index"] = str(index)
        env = {
            "LWS_LEADER_ADDRESS": f"{name}-0.{name}.default",
            "LWS_GROUP_SIZE": str(size),
            "LWS_WORKER_INDEX": str(index),
        }
        pods.append((labels, env))
    return pods


def container(template: dict) -> dict:
    (c,) = template["spec"]["containers"]
    return c


def plain_env(c: dict) -> dict[str, str]:
    return {e["name"]: e["value"] for e in c.get("env", []) if "value" in e}


def named_ports(c: dict) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in c.get("ports", [])}


def cli_args(c: dict, command: str):
    """The container's arguments parsed by moeserve's CLI (the image's entrypoint is moeserve)
    as ``command``."""
    assert "command" not in c, "a command would replace the image's entrypoint (tini, moeserve)"
    try:
        args = build_parser().parse_args(c["args"])
    except SystemExit:  # argparse printed why
        pytest.fail(f"moeserve's CLI rejects the container's args {c['args']}")
    assert args.command == command
    return args


def serve_args(c: dict):
    """The container's ``serve`` arguments, with no topology flag (LWS's variables set it)."""
    args = cli_args(c, "serve")
    defaults = build_parser().parse_args(["serve"])
    given = [f for f in TOPOLOGY_FLAGS if getattr(args, f) != getattr(defaults, f)]
    assert given == [], f"{given}: leave these to LeaderWorkerSet's variables (moeserve.launch.lws)"
    return args


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


# ---- consistency --------------------------------------------------------------------------------


def test_lws_variables_map_to_node_ranks_that_cover_the_world():
    lws = only("LeaderWorkerSet")
    size = lws["spec"]["leaderWorkerTemplate"]["size"]
    templates = dict(pod_templates())
    rendezvous = named_ports(container(templates["leader"]))["rendezvous"]
    ranks, worlds = [], set()
    for index, (_, injected) in enumerate(lws_pods()):
        c = container(templates["leader" if index == 0 else "worker"])
        args = serve_args(c)
        topology = apply_lws({**plain_env(c), **injected}, None, None, None, None)
        assert topology == (size, index, injected["LWS_LEADER_ADDRESS"], rendezvous)
        args.nnodes, args.node_rank, args.master_addr, args.master_port = topology
        config = EngineConfig(**engine_kwargs(args))
        worlds.add(config.parallel_dims.world_size)
        specs = plan_local_ranks(config.parallel_dims.world_size, *topology)
        assert {s.node_rank for s in specs} == {index}
        ranks += [s.rank for s in specs]
    (world,) = worlds
    assert sorted(ranks) == list(range(world))


def test_leader_and_workers_run_the_same_engine():
    templates = dict(pod_templates())
    leader, worker = (container(templates[r]) for r in ("leader", "worker"))
    assert leader["args"] == worker["args"]
    assert leader["image"] == worker["image"]
    assert plain_env(leader) == plain_env(worker)


def test_the_one_host_deployment_is_not_a_group():
    c = container(only("Deployment")["spec"]["template"])
    args = serve_args(c)
    assert apply_lws(plain_env(c), None, None, None, None) == (1, 0, None, None)
    EngineConfig(**engine_kwargs(args))


@pytest.mark.parametrize("role", ["leader", "server"])
def test_the_api_listens_where_probes_and_services_look(role):
    c = container(dict(pod_templates())[role])
    args = serve_args(c)
    options = ServeOptions(host=args.host, port=args.port)
    assert options.host in ("0.0.0.0", "::"), "the API must listen beyond the pod's loopback"
    assert named_ports(c)["http"] == options.port
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"] == {"path": "/health", "port": "http"}, probe
    key = next(e for e in c["env"] if e["name"] == "MOESERVE_API_KEY")
    assert "secretKeyRef" in key["valueFrom"], "the API key comes from a Secret, not the manifest"


def test_workers_have_no_http_port_or_probe():
    c = container(dict(pod_templates())["worker"])
    assert "ports" not in c
    assert not {"startupProbe", "readinessProbe", "livenessProbe"} & set(c)


def test_the_lws_service_selects_the_leaders_only():
    service = only("Service", "moeserve")
    pods = lws_pods()
    assert selects(service["spec"]["selector"], pods[0][0])
    assert not any(selects(service["spec"]["selector"], labels) for labels, _ in pods[1:])
    server = dict(pod_templates())["server"]["metadata"]["labels"]
    assert not selects(service["spec"]["selector"], server)
    (port,) = service["spec"]["ports"]
    assert port["targetPort"] in named_ports(container(dict(pod_templates())["leader"]))


def test_the_one_host_service_and_deployment_select_its_pods_only():
    deployment, service = only("Deployment"), only("Service", "moeserve-one-host")
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert selects(deployment["spec"]["selector"]["matchLabels"], labels)
    assert selects(service["spec"]["selector"], labels)
    assert not any(selects(service["spec"]["selector"], pod) for pod, _ in lws_pods())
    (port,) = service["spec"]["ports"]
    assert port["targetPort"] in named_ports(container(deployment["spec"]["template"]))


def test_the_podmonitor_scrapes_every_api_and_no_worker():
    monitor = only("PodMonitor")["spec"]
    (endpoint,) = monitor["podMetricsEndpoints"]
    assert endpoint["path"] == "/metrics"
    for role, template in pod_templates():
        c = container(template)
        assert selects(monitor["selector"]["matchLabels"], template["metadata"]["labels"])
        assert (endpoint["port"] in named_ports(c)) == (role != "worker"), role


@pytest.mark.parametrize("role", ["leader", "worker", "server"])
def test_the_grace_period_covers_the_drain(role):
    """The leader (and a one-host pod) waits out its preStop, drains for --shutdown-timeout
    and stops its ranks; a worker waits in its preStop until the leader has drained, since the
    leader ending the group is what ends the worker."""
    templates = dict(pod_templates())
    c, spec = container(templates[role]), templates[role]["spec"]
    drain = serve_args(c).shutdown_timeout
    pre_stop = c["lifecycle"]["preStop"]["sleep"]["seconds"]
    if role == "worker":
        leader = container(templates["leader"])["lifecycle"]["preStop"]["sleep"]["seconds"]
        assert pre_stop >= leader + drain
        assert spec["terminationGracePeriodSeconds"] >= pre_stop + 10
    else:
        assert spec["terminationGracePeriodSeconds"] >= pre_stop + drain + 10


@pytest.mark.parametrize("role", ["leader", "worker", "server"])
def test_pods_are_guaranteed_whole_cpus(role):
    """requests == limits with whole CPUs: Guaranteed QoS, so that the static CPU manager hands
    out whole cores for moeserve to pin its ranks to."""
    resources = container(dict(pod_templates())[role])["resources"]
    assert resources["requests"] == resources["limits"]
    assert re.fullmatch(r"[1-9][0-9]*", str(resources["requests"]["cpu"]))
    lws = dict(pod_templates())
    assert container(lws["leader"])["resources"] == container(lws["worker"])["resources"]


@pytest.mark.parametrize("role", ["leader", "worker", "server"])
def test_no_service_variables_reach_moeserve(role):
    # a Service named moeserve would otherwise set MOESERVE_PORT=tcp://... in every pod
    assert dict(pod_templates())[role]["spec"]["enableServiceLinks"] is False


_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
_LABEL_VALUE = re.compile(r"(([A-Za-z0-9][-A-Za-z0-9_.]{0,61})?[A-Za-z0-9])?")
_PORT_NAME = re.compile(r"(?=.{1,15}$)(?=.*[a-z])[a-z0-9]+(-[a-z0-9]+)*")


def naming_errors(docs, templates, extra_names=()) -> list[str]:
    """What the schemas do not say: object names (and ``extra_names``, e.g. pod names) as DNS
    labels, label values, port names; of ``docs`` and the pod ``templates``."""
    names, labels, ports = [*extra_names], [], []
    for doc in docs:
        names.append(doc["metadata"]["name"])
        labels += doc["metadata"].get("labels", {}).values()
    for template in templates:
        labels += template["metadata"]["labels"].values()
        ports += named_ports(container(template))
    for service in (d for d in docs if d["kind"] == "Service"):
        labels += service["spec"]["selector"].values()
        ports += [p["name"] for p in service["spec"]["ports"]]
    return (
        [f"name {n!r}" for n in names if not _DNS_LABEL.fullmatch(n)]
        + [f"label value {v!r}" for v in labels if not _LABEL_VALUE.fullmatch(v)]
        + [f"port name {p!r}" for p in ports if not _PORT_NAME.fullmatch(p)]
    )


def test_names_pass_the_api_servers_own_checks():
    """What the schemas do not say: object names, label values and port names."""
    templates = [template for _, template in pod_templates()]
    assert naming_errors(DOCS.values(), templates) == []
