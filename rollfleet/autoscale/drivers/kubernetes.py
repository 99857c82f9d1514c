"""Deployments on Kubernetes: the worker Deployment's size through its scale subresource, and one
Deployment per held version, made from the worker Deployment.

- A follower is one more replica of the worker Deployment (``PATCH .../deployments/<name>/scale``).
- A replica held at version V is a replica of ``<name>-v<V>``: the worker Deployment's pod with
  ``--hold-version V``, its component label ``worker-held`` and ``rollfleet.io/held: "V"`` (so
  no two Deployments select the same pods), created at the first one and deleted with the last.
- Retiring a follower marks its pod first to go (``controller.kubernetes.io/pod-deletion-cost``)
  and scales the Deployment down by one: Kubernetes removes that pod, with SIGTERM and the pod's
  grace period, and the worker drains. A held version's last replica goes with its Deployment.
- A pod's worker calls itself ``<hostname>-<pid>``, its hostname the pod's name: runs are matched
  to registry entries by host.

The requests are built by pure functions (``set_scale``, ``held_deployment``, ``deletion_cost``,
``runs_of``) and sent by ``KubernetesDriver`` with the pod's service account (in-cluster). No
Kubernetes API server runs where rollfleet is tested: the requests are checked as data against
Kubernetes' own schemas (``tests/test_deploy_helm.py``), and the RBAC the chart grants against the
requests this module can make; none has been sent to a server by the tests.
"""

from __future__ import annotations

import asyncio
import copy
import json
import os
import ssl
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from rollfleet.autoscale.drivers.base import Run
from rollfleet.runtime.logs import get_logger

log = get_logger("rollfleet.autoscale.kubernetes")

HELD_LABEL = "rollfleet.io/held"
COMPONENT = "app.kubernetes.io/component"
DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"
SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")


@dataclass(frozen=True)
class ApiRequest:
    method: str
    path: str
    body: dict[str, Any] | None = None
    content_type: str = "application/json"
    # (apiGroup, resource, verb): what RBAC must grant for it
    grant: tuple[str, str, str] = ("", "", "")


def deployment_path(namespace: str, name: str | None = None) -> str:
    base = f"/apis/apps/v1/namespaces/{namespace}/deployments"
    return base if name is None else f"{base}/{name}"


def get_deployment(namespace: str, name: str) -> ApiRequest:
    return ApiRequest("GET", deployment_path(namespace, name), grant=("apps", "deployments", "get"))


def get_scale(namespace: str, name: str) -> ApiRequest:
    return ApiRequest("GET", f"{deployment_path(namespace, name)}/scale", grant=("apps", "deployments/scale", "get"))


def set_scale(namespace: str, name: str, replicas: int) -> ApiRequest:
    body = {"spec": {"replicas": int(replicas)}}
    path = f"{deployment_path(namespace, name)}/scale"
    return ApiRequest("PATCH", path, body, "application/merge-patch+json", ("apps", "deployments/scale", "patch"))


def create_deployment(namespace: str, deployment: dict[str, Any]) -> ApiRequest:
    return ApiRequest("POST", deployment_path(namespace), deployment, grant=("apps", "deployments", "create"))


def delete_deployment(namespace: str, name: str) -> ApiRequest:
    body = {"kind": "DeleteOptions", "apiVersion": "v1", "propagationPolicy": "Foreground"}
    return ApiRequest("DELETE", deployment_path(namespace, name), body, grant=("apps", "deployments", "delete"))


def list_pods(namespace: str, selector: str) -> ApiRequest:
    query = urllib.parse.urlencode({"labelSelector": selector})
    return ApiRequest("GET", f"/api/v1/namespaces/{namespace}/pods?{query}", grant=("", "pods", "list"))


def deletion_cost(namespace: str, pod: str, cost: int = -1000) -> ApiRequest:
    """Make ``pod`` the first its ReplicaSet removes when the Deployment shrinks."""
    body = {"metadata": {"annotations": {DELETION_COST: str(cost)}}}
    path = f"/api/v1/namespaces/{namespace}/pods/{pod}"
    return ApiRequest("PATCH", path, body, "application/merge-patch+json", ("", "pods", "patch"))


def held_name(worker_deployment: str, version: int) -> str:
    return f"{worker_deployment}-v{int(version)}"


def held_deployment(worker: dict[str, Any], version: int) -> dict[str, Any]:
    """The Deployment holding ``version``: the worker Deployment's pod with ``--hold-version``,
    one replica, labels of its own (no two Deployments select the same pods)."""
    name = held_name(worker["metadata"]["name"], version)
    labels = {**worker["spec"]["selector"]["matchLabels"], COMPONENT: "worker-held", HELD_LABEL: str(version)}
    template = copy.deepcopy(worker["spec"]["template"])
    template.setdefault("metadata", {})["labels"] = {**template["metadata"].get("labels", {}), **labels}
    for container in template["spec"]["containers"]:
        if container["name"] == "worker":
            container["args"] = [*container.get("args", []), "--hold-version", str(int(version))]
    meta_labels = {**worker["metadata"].get("labels", {}), COMPONENT: "worker-held", HELD_LABEL: str(version)}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "namespace": worker["metadata"].get("namespace"), "labels": meta_labels},
        "spec": {"replicas": 1, "selector": {"matchLabels": labels}, "template": template},
    }


def worker_selector(worker: dict[str, Any]) -> str:
    """Every worker pod of the release, followers and held ones."""
    labels = {k: v for k, v in worker["spec"]["selector"]["matchLabels"].items() if k != COMPONENT}
    parts = [f"{k}={v}" for k, v in sorted(labels.items())]
    return ",".join([*parts, f"{COMPONENT} in (worker,worker-held)"])


def _time(text: str | None) -> float:
    if not text:
        return 0.0
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def runs_of(pods: dict[str, Any]) -> list[Run]:
    """The replicas a PodList shows: each pod's worker, the version it holds, and whether it is
    going (a deletion timestamp, or a phase past running)."""
    out = []
    for pod in pods.get("items", []):
        meta, status = pod.get("metadata", {}), pod.get("status", {})
        if status.get("phase") in ("Succeeded", "Failed"):
            continue
        held = meta.get("labels", {}).get(HELD_LABEL)
        name = meta["name"]
        going = meta.get("deletionTimestamp") is not None
        version = int(held) if held is not None else None
        out.append(Run(name, version, _time(meta.get("creationTimestamp")), going, name))
    return out


@dataclass
class KubernetesDriver:
    deployment: str  # the worker Deployment (the followers)
    namespace: str = ""  # default: the pod's own namespace
    api_url: str = ""  # default: in-cluster (KUBERNETES_SERVICE_HOST/PORT)
    token_file: Path = SERVICE_ACCOUNT / "token"
    ca_file: Path = SERVICE_ACCOUNT / "ca.crt"
    name: str = "kubernetes"
    _worker: dict[str, Any] | None = None
    _hosts: set[str] = field(default_factory=set)
    _pods: dict[str, Run] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.namespace:
            ns_file = SERVICE_ACCOUNT / "namespace"
            self.namespace = ns_file.read_text().strip() if ns_file.exists() else "default"
        if not self.api_url:
            host, port = os.environ.get("KUBERNETES_SERVICE_HOST"), os.environ.get("KUBERNETES_SERVICE_PORT", "443")
            self.api_url = f"https://{host}:{port}" if host else "https://kubernetes.default.svc"

    def _send(self, request: ApiRequest) -> dict[str, Any] | None:
        """One request; None for 404."""
        data = json.dumps(request.body).encode() if request.body is not None else None
        headers = {"Accept": "application/json", "Content-Type": request.content_type}
        if self.token_file.exists():
            headers["Authorization"] = f"Bearer {self.token_file.read_text().strip()}"
        req = urllib.request.Request(self.api_url + request.path, data, headers, method=request.method)
        context = ssl.create_default_context(cafile=str(self.ca_file)) if self.ca_file.exists() else None
        try:
            with urllib.request.urlopen(req, timeout=30, context=context) as resp:
                return json.loads(resp.read() or b"null")
        except urllib.error.HTTPError as exc:
            if exc.code == 404:
                return None
            raise RuntimeError(f"{request.method} {request.path}: {exc.code} {exc.read()[:500]!r}") from None

    async def _call(self, request: ApiRequest) -> dict[str, Any] | None:
        return await asyncio.to_thread(self._send, request)

    async def _worker_deployment(self) -> dict[str, Any]:
        if self._worker is None:
            found = await self._call(get_deployment(self.namespace, self.deployment))
            if found is None:
                raise RuntimeError(f"no Deployment {self.deployment} in namespace {self.namespace}")
            self._worker = found
        return self._worker

    def owns(self, worker_id: str, host: str = "") -> bool:
        return host in self._hosts

    async def runs(self) -> list[Run]:
        worker = await self._worker_deployment()
        pods = await self._call(list_pods(self.namespace, worker_selector(worker))) or {}
        found = runs_of(pods)
        self._pods = {r.worker_id: r for r in found}
        self._hosts |= set(self._pods)
        return found

    async def _resize(self, name: str, by: int) -> int:
        scale = await self._call(get_scale(self.namespace, name)) or {}
        replicas = max(0, int(scale.get("spec", {}).get("replicas", 0)) + by)
        await self._call(set_scale(self.namespace, name, replicas))
        return replicas

    async def launch(self, held: int | None) -> str:
        if held is None:
            return f"{self.deployment} x{await self._resize(self.deployment, +1)}"
        name = held_name(self.deployment, held)
        if await self._call(get_deployment(self.namespace, name)) is None:
            await self._call(create_deployment(self.namespace, held_deployment(await self._worker_deployment(), held)))
            return f"{name} x1"
        return f"{name} x{await self._resize(name, +1)}"

    async def retire(self, worker_id: str, host: str = "") -> None:
        run = self._pods.get(host or worker_id)
        if run is None or run.retiring:
            return
        if run.held is not None:
            name = held_name(self.deployment, run.held)
            if sum(r.held == run.held and not r.retiring for r in self._pods.values()) <= 1:
                await self._call(delete_deployment(self.namespace, name))  # (its pods drain on SIGTERM)
                return
        else:
            name = self.deployment
        await self._call(deletion_cost(self.namespace, run.worker_id))
        await self._resize(name, -1)

    async def close(self) -> None:
        return None


def requests_made(worker: dict[str, Any], namespace: str = "ns") -> list[ApiRequest]:
    """One of every request this driver makes (what RBAC must grant)."""
    name = worker["metadata"]["name"]
    return [
        get_deployment(namespace, name),
        list_pods(namespace, worker_selector(worker)),
        get_scale(namespace, name),
        set_scale(namespace, name, 2),
        create_deployment(namespace, held_deployment(worker, 3)),
        delete_deployment(namespace, held_name(name, 3)),
        deletion_cost(namespace, "pod-0"),
    ]
