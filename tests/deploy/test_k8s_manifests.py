"""The Kubernetes manifests in agents/k8s/, checked offline (no cluster runs here).

* Every Kubernetes object validates against the Kubernetes JSON schemas of
  ``kubernetes_validate`` (offline, strict: an unknown field is an error) for the oldest
  version they need (1.31: podFailurePolicy and elastic Indexed Jobs are GA there) and the
  newest the package knows.
* The PyTorchJob is a Kubeflow CRD, for which the package has no schema: a small explicit
  schema below checks the fields we rely on, following the training operator's
  ``pkg/apis/kubeflow.org/v1/pytorch_types.go`` and ``pytorch_validation.go``; its pod template
  is checked against the real Kubernetes schema as a ``PodTemplate``.
* What matters to us: every agent container runs ``elastic-agent`` with the etcd-v3
  rendezvous at the etcd Service, parsed by torchrun's own parser (for the PyTorchJob with the
  ``PET_*`` variables the operator would set); the grace period exceeds the agent's planned
  leave; the preStop hook signals the agent; no secret is an environment value; checkpoints
  are on a ReadWriteMany claim or S3; etcd has 3 TLS members.
"""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import jsonschema
import kubernetes_validate
import pytest
import yaml

from elastic.agent.launch import translate_argv
from elastic.rendezvous.options import RendezvousOptions
from elastic_tools.training.config import load_config

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "agents" / "k8s"
VERSIONS = ["1.31", kubernetes_validate.utils.latest_version()]
CRDS = {("kubeflow.org/v1", "PyTorchJob")}
AGENT_LABEL = "elastic-agent"  # app.kubernetes.io/name of the agents' pods
ETCD_ENDPOINT = "etcd-client:2379"


def _documents() -> list[tuple[str, dict[str, Any]]]:
    docs = []
    for path in sorted(K8S.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc is not None:
                docs.append((path.name, doc))
    return docs


DOCS = _documents()


def _named(kind: str, name: str) -> dict[str, Any]:
    found = [d for _, d in DOCS if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind} {name} in agents/k8s/"
    return found[0]


def _pod_specs(doc: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """The pod templates of a workload (a Job, a StatefulSet, a PyTorchJob's replicas)."""
    if doc["kind"] == "PyTorchJob":
        for replica in doc["spec"]["pytorchReplicaSpecs"].values():
            yield replica["template"]
    elif doc["kind"] in ("Job", "StatefulSet"):
        yield doc["spec"]["template"]


def _containers(template: dict[str, Any]) -> list[dict[str, Any]]:
    spec = template["spec"]
    return [*spec.get("initContainers", []), *spec["containers"]]


def _agent_pods() -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(workload, pod template) for every pod labelled as an agent."""
    return [
        (doc, t)
        for _, doc in DOCS
        for t in _pod_specs(doc)
        if t["metadata"]["labels"].get("app.kubernetes.io/name") == AGENT_LABEL
    ]


def test_the_manifests_hold_what_the_docs_promise() -> None:
    kinds = sorted((f, d["kind"], d["metadata"]["name"]) for f, d in DOCS)
    assert kinds == [
        ("agents.yaml", "Job", "elastic-agents"),
        ("agents.yaml", "PersistentVolumeClaim", "elastic-checkpoints"),
        ("etcd-init.yaml", "Job", "elastic-etcd-init"),
        ("etcd.yaml", "PodDisruptionBudget", "etcd"),
        ("etcd.yaml", "Service", "etcd"),
        ("etcd.yaml", "Service", "etcd-client"),
        ("etcd.yaml", "StatefulSet", "etcd"),
        ("pytorchjob.yaml", "PyTorchJob", "elastic-cnn"),
    ]


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize(
    "name, doc",
    [(f"{f}:{d['kind']}/{d['metadata']['name']}", d) for f, d in DOCS],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_kubernetes_schema_strict(name: str, doc: dict[str, Any], version: str) -> None:
    if (doc["apiVersion"], doc["kind"]) in CRDS:
        with pytest.raises(kubernetes_validate.SchemaNotFoundError):
            kubernetes_validate.validate(doc, version, strict=True)
        for template in _pod_specs(doc):  # what we can check of a CRD with the real schema
            pod_template = {"apiVersion": "v1", "kind": "PodTemplate", "template": template}
            pod_template["metadata"] = {"name": doc["metadata"]["name"]}
            kubernetes_validate.validate(pod_template, version, strict=True)
        return
    kubernetes_validate.validate(doc, version, strict=True)


def test_strict_validation_catches_an_unknown_field() -> None:
    """The check above can fail: a misspelt field is refused."""
    job = yaml.safe_load(yaml.safe_dump(_named("Job", "elastic-agents")))
    job["spec"]["template"]["spec"]["terminationGracePeriodSecond"] = 120
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(job, VERSIONS[-1], strict=True)


_DNS_1035 = r"^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$"
_PORT = {"type": "integer", "minimum": 1, "maximum": 65535}
_REPLICA = {
    "type": "object",
    "required": ["replicas", "template"],
    "additionalProperties": False,
    "properties": {
        "replicas": {"type": "integer", "minimum": 1},
        "restartPolicy": {"enum": ["Always", "OnFailure", "Never", "ExitCode"]},
        "template": {"type": "object", "required": ["spec"]},
    },
}
# The PyTorchJob fields we rely on (kubeflow.org/v1, training operator pytorch_types.go).
PYTORCHJOB_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "kubeflow.org/v1"},
        "kind": {"const": "PyTorchJob"},
        "metadata": {
            "type": "object",
            "required": ["name"],
            "properties": {"name": {"type": "string", "pattern": _DNS_1035}},
        },
        "spec": {
            "type": "object",
            "required": ["elasticPolicy", "pytorchReplicaSpecs"],
            "additionalProperties": False,
            "properties": {
                "runPolicy": {"type": "object"},
                "nprocPerNode": {"type": "string"},
                "elasticPolicy": {
                    "type": "object",
                    "required": ["rdzvBackend", "rdzvHost", "rdzvPort", "minReplicas"],
                    "additionalProperties": False,
                    "properties": {
                        "rdzvBackend": {"const": "etcd-v3"},
                        "rdzvHost": {"type": "string", "minLength": 1},
                        "rdzvPort": _PORT,
                        "rdzvId": {"type": "string", "minLength": 1},
                        "rdzvConf": {
                            "type": "array",
                            "items": {
                                "type": "object",
                                "required": ["key", "value"],
                                "additionalProperties": False,
                                "properties": {
                                    "key": {"type": "string"},
                                    "value": {"type": "string"},
                                },
                            },
                        },
                        "minReplicas": {"type": "integer", "minimum": 1},
                        "maxReplicas": {"type": "integer", "minimum": 1},
                        "maxRestarts": {"type": "integer", "minimum": 0},
                    },
                },
                "pytorchReplicaSpecs": {
                    "type": "object",
                    "required": ["Worker"],
                    "additionalProperties": False,
                    "properties": {"Master": _REPLICA, "Worker": _REPLICA},
                },
            },
        },
    },
}


def test_pytorchjob_fields_we_rely_on() -> None:
    job = _named("PyTorchJob", "elastic-cnn")
    jsonschema.validate(job, PYTORCHJOB_SCHEMA)
    policy = job["spec"]["elasticPolicy"]
    assert policy["minReplicas"] <= job["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"]
    assert job["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] <= policy["maxReplicas"]
    for template in _pod_specs(job):  # pytorch_validation.go: a container named pytorch
        assert "pytorch" in [c["name"] for c in template["spec"]["containers"]]
    wrong = yaml.safe_load(yaml.safe_dump(job))
    wrong["spec"]["elasticPolicy"]["rdzvBackend"] = "c10d"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(wrong, PYTORCHJOB_SCHEMA)


def _operator_env(job: dict[str, Any]) -> dict[str, str]:
    """The PET_* variables the training operator gives each pod of an elastic PyTorchJob
    (pkg/controller.v1/pytorch/elastic.go, ElasticEnvVarGenerator)."""
    if job["kind"] != "PyTorchJob":
        return {}
    p = job["spec"]["elasticPolicy"]
    out = {
        "PET_RDZV_ENDPOINT": f"{p['rdzvHost']}:{p['rdzvPort']}",
        "PET_RDZV_BACKEND": p.get("rdzvBackend", "c10d"),
        "PET_NNODES": f"{p['minReplicas']}:{p['maxReplicas']}",
    }
    if "maxRestarts" in p:
        out["PET_MAX_RESTARTS"] = str(p["maxRestarts"])
    if "rdzvId" in p:
        out["PET_RDZV_ID"] = p["rdzvId"]
    if p.get("rdzvConf"):
        out["PET_RDZV_CONF"] = ",".join(f"{c['key']}={c['value']}" for c in p["rdzvConf"])
    return out


def _parse_agent(container: dict[str, Any], pet_env: dict[str, str]) -> argparse.Namespace:
    """The container's arguments as elastic-agent parses them (its parser is torchrun's, with
    --rdzv-backend etcd-v3 by default and --metrics-port, as in elastic.agent.launch)."""
    from torch.distributed.run import get_args_parser

    with mock.patch.dict(os.environ, pet_env):  # torchrun reads PET_* when it builds
        parser = get_args_parser()
    parser.set_defaults(rdzv_backend="etcd-v3")
    parser.add_argument("--metrics-port", "--metrics_port", type=int, default=None)
    flags = {o for a in parser._actions if a.nargs == 0 for o in a.option_strings}
    # The entrypoint puts --local-addr=<pod IP> first.
    return parser.parse_args(translate_argv(["--local-addr=10.0.0.7", *container["args"]], flags))


def _conf(args: argparse.Namespace) -> dict[str, str]:
    from torch.distributed.elastic.rendezvous.utils import _parse_rendezvous_config

    return _parse_rendezvous_config(args.rdzv_conf)


def _agent_containers() -> list[tuple[dict[str, Any], dict[str, Any], dict[str, Any]]]:
    return [(doc, t, c) for doc, t in _agent_pods() for c in t["spec"]["containers"]]


def test_there_are_two_agent_workloads() -> None:
    names = sorted(f"{doc['kind']}/{doc['metadata']['name']}" for doc, _ in _agent_pods())
    assert names == ["Job/elastic-agents", "PyTorchJob/elastic-cnn"]


def test_every_agent_container_runs_elastic_agent_on_our_etcd_v3_rendezvous() -> None:
    for doc, _, container in _agent_containers():
        assert container["command"] == ["elastic-entrypoint", "elastic-agent"], doc["kind"]
        args = _parse_agent(container, _operator_env(doc))
        assert args.rdzv_backend == "etcd-v3"
        assert args.rdzv_endpoint == ETCD_ENDPOINT
        assert args.module and args.training_script == "elastic_tools.training.worker"
        assert re.fullmatch(r"\d+:\d+", args.nnodes), "elastic: MIN:MAX nodes"
        conf = _conf(args)
        assert conf["protocol"] == "https" and conf["password_file"].startswith("/run/secrets/")
        assert "password" not in conf, "the password must come from a file"
        options = RendezvousOptions.parse({k: v for k, v in conf.items() if k != "password_file"})
        assert options.user == "elastic" and options.cacert


def test_the_rendezvous_endpoint_is_the_etcd_client_service() -> None:
    service = _named("Service", "etcd-client")
    host, port = ETCD_ENDPOINT.split(":")
    assert service["metadata"]["name"] == host
    assert int(port) in [p["port"] for p in service["spec"]["ports"]]
    init_env = {
        e["name"]: e["value"] for e in _containers(_pod_template("elastic-etcd-init"))[0]["env"]
    }
    assert init_env["ETCD_ENDPOINT"] == ETCD_ENDPOINT


def _pod_template(job_name: str) -> dict[str, Any]:
    return _named("Job", job_name)["spec"]["template"]


def test_the_worker_config_and_its_overrides_validate() -> None:
    for doc, _, container in _agent_containers():
        args = _parse_agent(container, _operator_env(doc))
        worker = list(args.training_script_args)
        at = worker.index("--config")
        environ = {e["name"]: e["value"] for e in container["env"] if "value" in e}
        config = load_config(REPO / worker[at + 1], worker[at + 2 :], environ=environ)
        assert config.checkpoint.url == environ["ELASTIC_CHECKPOINT__URL"]


def _leave_time_s(doc: dict[str, Any], container: dict[str, Any]) -> float:
    """The agent's planned leave at most: torch gives the workers --shutdown-timeout (default
    30 s) to finish their step and checkpoint, then the agent leaves the rendezvous in one
    etcd request, which rides out an outage for up to request_timeout."""
    args = _parse_agent(container, _operator_env(doc))
    conf = _conf(args)
    options = RendezvousOptions.parse({k: v for k, v in conf.items() if k != "password_file"})
    shutdown = 30 if args.shutdown_timeout is None else args.shutdown_timeout
    return float(shutdown) + options.request_timeout


def test_the_grace_period_exceeds_the_agents_planned_leave() -> None:
    for doc, template, container in _agent_containers():
        grace = template["spec"]["terminationGracePeriodSeconds"]
        leave = _leave_time_s(doc, container)
        assert grace > leave, f"{doc['metadata']['name']}: grace {grace} s <= leave {leave} s"
        assert leave >= 60, "the workers' last checkpoint needs its time too"


def test_prestop_sends_sigterm_to_the_agent_and_waits_for_it() -> None:
    for doc, _, container in _agent_containers():
        hook = container["lifecycle"]["preStop"]["exec"]["command"]
        assert hook[:2] == ["/bin/sh", "-c"], doc["metadata"]["name"]
        assert re.match(r"^kill -TERM 1; while kill -0 1 2>/dev/null; do sleep 1; done$", hook[2])


def _secret_mounts(template: dict[str, Any], container: dict[str, Any]) -> list[str]:
    secret_volumes = {v["name"] for v in template["spec"].get("volumes", []) if "secret" in v}
    return [
        m["mountPath"] for m in container.get("volumeMounts", []) if m["name"] in secret_volumes
    ]


_SECRETISH = re.compile(r"PASSWORD|SECRET|TOKEN|CREDENTIAL|_KEY$|^KEY$", re.IGNORECASE)


def test_no_secret_is_an_environment_value() -> None:
    checked = 0
    for _, doc in DOCS:
        for template in _pod_specs(doc):
            for container in _containers(template):
                mounts = _secret_mounts(template, container)
                assert "envFrom" not in container
                for var in container.get("env", []):
                    assert "secretKeyRef" not in var.get("valueFrom", {}), var["name"]
                    if _SECRETISH.search(var["name"]):
                        checked += 1
                        value = var["value"]
                        assert any(value.startswith(m + "/") for m in mounts), (
                            f"{var['name']} must name a file of a mounted Secret, not a value"
                        )
                joined = " ".join(container.get("args", []))
                assert "password=" not in joined.replace("password_file=", "")
    assert checked >= 5, "the check must have met the secret file variables"


def test_secret_volumes_are_readable_by_the_pod_only() -> None:
    for _, doc in DOCS:
        for template in _pod_specs(doc):
            spec = template["spec"]
            for volume in spec.get("volumes", []):
                if "secret" in volume:
                    assert volume["secret"]["defaultMode"] == 0o440, volume["name"]
                    assert spec["securityContext"]["fsGroup"], "the group that may read them"
                    assert spec["securityContext"]["runAsNonRoot"] is True


def test_checkpoints_are_shared_by_every_pod() -> None:
    claims = {d["metadata"]["name"]: d for _, d in DOCS if d["kind"] == "PersistentVolumeClaim"}
    for doc, template, container in _agent_containers():
        url = {e["name"]: e.get("value") for e in container["env"]}["ELASTIC_CHECKPOINT__URL"]
        if url.startswith("s3://"):
            continue
        mount = next(m for m in container["volumeMounts"] if url.startswith(m["mountPath"]))
        volume = next(v for v in template["spec"]["volumes"] if v["name"] == mount["name"])
        claim = claims[volume["persistentVolumeClaim"]["claimName"]]
        assert claim["spec"]["accessModes"] == ["ReadWriteMany"], doc["metadata"]["name"]
    urls = [
        {e["name"]: e.get("value") for e in c["env"]}["ELASTIC_CHECKPOINT__URL"]
        for *_, c in _agent_containers()
    ]
    assert any(u.startswith("s3://") for u in urls) and any(u.startswith("/") for u in urls)


def test_etcd_is_three_tls_members_with_client_certificates() -> None:
    sts = _named("StatefulSet", "etcd")
    assert sts["spec"]["replicas"] == 3
    service = _named("Service", sts["spec"]["serviceName"])
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"]
    (container,) = sts["spec"]["template"]["spec"]["containers"]
    flags = dict(a.removeprefix("--").split("=", 1) for a in container["args"])
    members = [f"etcd-{i}=https://etcd-{i}.{service['metadata']['name']}:2380" for i in range(3)]
    assert flags["initial-cluster"] == ",".join(members)
    assert flags["listen-client-urls"].startswith("https://")
    assert flags["client-cert-auth"] == "true" and flags["peer-client-cert-auth"] == "true"
    tls = _secret_mounts(sts["spec"]["template"], container)
    for name in ("cert-file", "key-file", "trusted-ca-file", "peer-cert-file", "peer-key-file"):
        assert any(flags[name].startswith(m + "/") for m in tls), name
    pdb = _named("PodDisruptionBudget", "etcd")
    assert pdb["spec"]["minAvailable"] == 2
