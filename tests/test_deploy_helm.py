"""deploy/helm/rollfleet rendered by Helm's own engine (helm-python-sdk: the Helm v4 Go SDK
through its C library, no helm binary) and every manifest validated against Kubernetes' schemas
(kubernetes-validate, strict: unknown fields refused); the KEDA ScaledObject against KEDA's
own CRD models. The workers get docker-compose.yml's worker flags and environment. The
kubernetes driver's requests are checked as data against the same schemas, and the chart's RBAC
against them: no API server runs here, nothing is sent.

The NATS chart is a dependency fetched by ``helm dependency build`` from its repository, which
no machine of this project reaches: its manifests are not rendered here; what the chart asks of
it (3 JetStream nodes) is read from the values."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

helm = pytest.importorskip("helm_python", reason="helm-python-sdk (the test extra) renders the chart")
kubernetes_validate = pytest.importorskip("kubernetes_validate")

from rollfleet.autoscale.drivers.kubernetes import (  # noqa: E402
    held_deployment,
    requests_made,
    runs_of,
    set_scale,
)

REPO = Path(__file__).resolve().parents[1]
CHART = REPO / "deploy" / "helm" / "rollfleet"
K8S_VERSION = "1.31"

VARIANTS = {
    "defaults": {},
    "keda": {"keda": {"enabled": True}},
    "gpu-engine-beside": {
        "worker": {
            "engine": "sglang",
            "resources": {"limits": {"cpu": "4", "memory": "16Gi"}},
            "server": {"enabled": True},
            "nodeSelector": {"nvidia.com/gpu.present": "true"},
        }
    },
    "object-store": {"store": {"url": "s3://bucket/policy"}, "storeSecret": "rollfleet-s3"},
    "gateway-key": {"gateway": {"apiKeySecret": "rollfleet-gateway", "replicas": 2}, "autoscaler": {"replicas": 2}},
}


def render(values: dict[str, Any]) -> list[dict[str, Any]]:
    with helm.Chart.load(str(CHART)) as chart:
        manifests = chart.render(values, name="rf", namespace="fleet")
    docs = []
    for text in manifests.values():
        docs += [d for d in yaml.safe_load_all(text) if d]
    return docs


def by_kind(docs: list[dict[str, Any]], kind: str, suffix: str) -> dict[str, Any]:
    [found] = [d for d in docs if d["kind"] == kind and d["metadata"]["name"].endswith(suffix)]
    return found


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_every_rendered_manifest_is_valid_kubernetes(variant: str) -> None:
    docs = render(VARIANTS[variant])
    kinds = sorted({d["kind"] for d in docs})
    for doc in docs:
        if doc["apiVersion"].startswith("keda.sh/"):
            from cloudcoil.models.keda import v1alpha1 as keda

            parsed = keda.ScaledObject.model_validate(doc)
            # (the models keep unknown fields out of a dump: a field KEDA does not know shows here)
            assert parsed.model_dump(by_alias=True, exclude_unset=True, mode="json") == doc
            continue
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    expected = {"Deployment", "Service", "ServiceAccount", "Role", "RoleBinding"}
    assert expected <= set(kinds), kinds
    assert ("ScaledObject" in kinds) == (variant == "keda")


def _compose_worker() -> tuple[list[str], dict[str, str], dict[str, Any]]:
    """docker-compose.yml's worker: its command and environment with every variable at its default."""
    compose = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    worker = compose["services"]["worker"]

    def default(text: str) -> str:
        return re.sub(r"\$\{(\w+)(:?-)([^}]*)\}", lambda m: m.group(3), text)

    command = default(worker["command"]).split()
    env = {k: default(str(v)) for k, v in worker["environment"].items()}
    return command, env, worker


def _flags(args: list[str]) -> dict[str, str]:
    """``--flag value`` pairs (every worker flag here takes a value)."""
    assert args[0] == "worker"
    rest = args[1:]
    assert len(rest) % 2 == 0 and all(a.startswith("--") for a in rest[::2]), rest
    return dict(zip(rest[::2], rest[1::2], strict=True))


def test_rendered_workers_get_the_compose_workers_flags_and_environment() -> None:
    command, env, service = _compose_worker()
    docs = render({})
    worker = by_kind(docs, "Deployment", "-worker")
    pod = worker["spec"]["template"]["spec"]
    [container] = [c for c in pod["containers"] if c["name"] == "worker"]
    chart_flags, compose_flags = _flags(container["args"]), _flags(command)
    # The broker's address is where each runs it; the chart's JetStream cluster has 3 nodes, so
    # the streams it declares keep 3 replicas (compose runs one broker).
    assert chart_flags.pop("--nats") == "nats://rf-nats:4222" and compose_flags.pop("--nats") == "nats://nats:4222"
    assert chart_flags.pop("--replicas") == "3"
    assert chart_flags == compose_flags
    assert {e["name"]: e["value"] for e in container["env"]} == env
    mounts = {m["mountPath"]: m.get("readOnly", False) for m in container["volumeMounts"]}
    [weights] = [v for v in service["volumes"] if v.endswith(":/weights:ro")]
    assert mounts["/weights"] is True and weights  # the store, read-only, where compose mounts it
    grace = int(service["stop_grace_period"].rstrip("s"))
    assert pod["terminationGracePeriodSeconds"] == grace  # SIGTERM, then this long to drain
    # Compose runs an init as PID 1 (`init: true`); the pod's is its pause process (below).
    assert service["init"] is True and pod["shareProcessNamespace"] is True


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_no_rollfleet_process_is_its_pods_pid_1(variant: str) -> None:
    """PID 1 gets no signal it has not set a handler for: a SIGTERM that comes while a worker is
    still importing or connecting is dropped, and the pod waits out its whole grace for SIGKILL;
    and PID 1 must reap the orphans of every process below it. Compose gives each rollfleet
    service an init (`init: true`); every pod of the chart shares its process namespace, so its
    pause process is PID 1 (it reaps) and each container's process gets SIGTERM with its default
    action (ending it) until it drains on its own handler. So do the pods of a held version."""
    compose = yaml.safe_load((REPO / "docker-compose.yml").read_text())["services"]
    assert compose["worker"]["init"] is True and compose["gateway"]["init"] is True
    docs = render(VARIANTS[variant])
    deployments = [d for d in docs if d["kind"] == "Deployment"]
    assert {d["metadata"]["name"].rsplit("-", 1)[1] for d in deployments} >= {"worker", "gateway", "autoscaler"}
    worker = by_kind(docs, "Deployment", "-worker")
    worker["metadata"]["namespace"] = "fleet"
    for deployment in [*deployments, held_deployment(worker, 3)]:
        assert deployment["spec"]["template"]["spec"].get("shareProcessNamespace") is True, deployment["metadata"]


def test_the_chart_asks_the_nats_chart_for_3_jetstream_nodes_and_every_process_for_r3_streams() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    [nats] = [d for d in chart["dependencies"] if d["name"] == "nats"]
    assert nats["repository"].startswith("https://nats-io.github.io/") and nats["condition"] == "nats.enabled"
    values = yaml.safe_load((CHART / "values.yaml").read_text())["nats"]["config"]
    assert values["cluster"] == {"enabled": True, "replicas": 3} and values["jetstream"]["enabled"] is True
    for doc in render({}):
        if doc["kind"] == "Deployment":
            for c in doc["spec"]["template"]["spec"]["containers"]:
                if c["name"] in ("worker", "gateway", "autoscaler"):
                    assert c["args"][c["args"].index("--replicas") + 1] == "3", c["name"]


def test_keda_reads_the_autoscalers_endpoint_where_it_serves_it() -> None:
    docs = render({"keda": {"enabled": True}})
    scaled = by_kind(docs, "ScaledObject", "-worker")
    [trigger] = scaled["spec"]["triggers"]
    assert trigger["type"] == "metrics-api" and trigger["metadata"]["valueLocation"] == "classes.latest.desired"
    service = by_kind(docs, "Service", "-autoscaler")
    port = service["spec"]["ports"][0]["port"]
    assert trigger["metadata"]["url"] == f"http://{service['metadata']['name']}.fleet.svc:{port}/keda"
    autoscaler = by_kind(docs, "Deployment", "-autoscaler")
    args = autoscaler["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--driver") + 1] == "none"  # (KEDA carries the size out)
    assert scaled["spec"]["scaleTargetRef"]["name"] == by_kind(docs, "Deployment", "-worker")["metadata"]["name"]


def test_the_kubernetes_drivers_requests_are_valid_and_granted() -> None:
    docs = render({})
    worker = by_kind(docs, "Deployment", "-worker")
    worker["metadata"]["namespace"] = "fleet"
    held = held_deployment(worker, 3)
    kubernetes_validate.validate(held, K8S_VERSION, strict=True)
    assert held["metadata"]["name"] == "rf-rollfleet-worker-v3" and held["spec"]["replicas"] == 1
    [container] = [c for c in held["spec"]["template"]["spec"]["containers"] if c["name"] == "worker"]
    assert container["args"][-2:] == ["--hold-version", "3"]
    selector = held["spec"]["selector"]["matchLabels"]
    assert selector.items() <= held["spec"]["template"]["metadata"]["labels"].items()
    assert not selector.items() <= worker["spec"]["template"]["metadata"]["labels"].items()  # (no overlap)
    scale = set_scale("fleet", "rf-rollfleet-worker", 4)
    kubernetes_validate.validate(
        {"apiVersion": "autoscaling/v1", "kind": "Scale", "metadata": {"name": "rf-rollfleet-worker"}, **scale.body},
        K8S_VERSION,
        strict=True,
    )
    role = by_kind(docs, "Role", "-autoscaler")
    granted = {(g, r, v) for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"]
               for v in rule["verbs"]}  # fmt: skip
    needed = {req.grant for req in requests_made(worker)}
    assert needed <= granted, needed - granted
    assert granted <= needed  # (nothing granted that the driver does not use)


def test_a_pod_list_reads_as_the_replicas_it_runs() -> None:
    pods = {
        "items": [
            {"metadata": {"name": "w-a", "creationTimestamp": "2026-12-06T09:00:00Z", "labels": {}},
             "status": {"phase": "Running"}},
            {"metadata": {"name": "w-v3-b", "creationTimestamp": "2026-12-06T09:00:01Z",
                          "labels": {"rollfleet.io/held": "3"}}, "status": {"phase": "Pending"}},
            {"metadata": {"name": "w-c", "deletionTimestamp": "2026-12-06T09:01:00Z", "labels": {}},
             "status": {"phase": "Running"}},
            {"metadata": {"name": "w-d", "labels": {}}, "status": {"phase": "Succeeded"}},
        ]
    }  # fmt: skip
    runs = {r.worker_id: r for r in runs_of(pods)}
    assert set(runs) == {"w-a", "w-v3-b", "w-c"}
    assert runs["w-v3-b"].held == 3 and runs["w-c"].retiring and runs["w-a"].host == "w-a"
