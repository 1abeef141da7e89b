"""deploy/kubernetes/ against Kubernetes, the CLI and itself.

- every manifest validates against the Kubernetes 1.30 schemas (``kubernetes-validate``, strict: an
  unknown field fails), the PodMonitor against the subset of its CRD's schema in
  ``fixtures/kubernetes/`` (kubernetes-validate has no schemas for CRDs); a typo fails both;
- every ``mstb-sidecar`` container command, with ``$(VAR)`` expanded as the kubelet does from the
  container's env (each reference defined, by the downward API), parses with the real CLI's parser
  and passes the configuration model (``test_docs.configure``); TensorBoard's with TensorBoard's;
- the sidecar is a native sidecar (an init container with ``restartPolicy: Always``), so the Job
  completes; volumes, ports, annotations, the PodMonitor and the aggregate agree with each other;
- every container of the image is hardened and has requests and limits;
- the Dockerfile installs what pyproject.toml packages and runs the real console script;
- docs/kubernetes.md shows the manifests' commands as they are written;
- the sidecar's container command itself, with its paths moved to temporary directories, follows
  the bundled mindformers logs: the runs hold mindformers' loss and ``/metrics`` answers.

The kustomization (no schema either) is checked for what ``kubectl apply -k`` needs: every manifest
listed, every image named.
"""

from __future__ import annotations

import ast
import copy
import json
import re
import shutil
import signal
import subprocess
from importlib.metadata import distribution
from pathlib import Path
from typing import Any, Iterator

import jsonschema
import kubernetes_validate
import pytest
import yaml
from packaging.requirements import Requirement

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10 (requires-python): the same parser, which the test extra installs there
    import tomli as tomllib  # type: ignore[no-redef]

from fidelity import load_truth
from live_helpers import BIN, free_port, metrics, wait_until
from tb_read import scalars
from test_docs import COMMANDS, EXAMPLE, configure

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy" / "kubernetes"
KUBERNETES = "1.30"  # the oldest release the manifests are for: native sidecars are on by default from 1.29
PODMONITOR_SCHEMA = Path(__file__).parent / "fixtures" / "kubernetes" / "podmonitor-v1-subset.schema.json"
# What the downward API gives the fields the manifests use, in a pod of Job llama-pretrain.
JOB_NAME_LABEL = "batch.kubernetes.io/job-name"  # set on a Job's pods by the Job controller (1.27+)
HARDENED = {"runAsNonRoot": True, "readOnlyRootFilesystem": True, "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"]}, "seccompProfile": {"type": "RuntimeDefault"}}


def manifests(directory: Path = DEPLOY) -> list[tuple[str, dict[str, Any]]]:
    """(file name, object) of every object in ``directory``/*.yaml but the kustomization."""
    return [(path.name, doc) for path in sorted(directory.glob("*.yaml")) if path.name != "kustomization.yaml"
            for doc in yaml.safe_load_all(path.read_text()) if doc]


MANIFESTS = manifests()
BUCKET_DIR = DEPLOY / "object-storage"  # the variant that writes the runs to a bucket
BUCKET_MANIFESTS = manifests(BUCKET_DIR)


def one(kind: str, name: str | None = None) -> dict[str, Any]:
    [found] = [doc for _, doc in MANIFESTS if doc["kind"] == kind and name in (None, doc["metadata"]["name"])]
    return found


def pod_templates(docs: list[tuple[str, dict[str, Any]]] = MANIFESTS) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    """(workload, its pod template) of every Job and Deployment."""
    for _, doc in docs:
        if doc["kind"] in ("Job", "Deployment"):
            yield doc, doc["spec"]["template"]


def containers(docs: list[tuple[str, dict[str, Any]]] = MANIFESTS) -> Iterator[tuple[dict[str, Any], dict[str, Any], dict[str, Any]]]:
    """(workload, pod template, container) of every container and init container."""
    for workload, template in pod_templates(docs):
        for container in [*template["spec"].get("initContainers", []), *template["spec"]["containers"]]:
            yield workload, template, container


def by_name(name: str) -> dict[str, Any]:
    [found] = [c for _, _, c in containers() if c["name"] == name]
    return found


def downward(field: str, workload: dict[str, Any]) -> str:
    """The value the downward API gives ``field`` in a pod of ``workload`` (the fields used here)."""
    pod_name = f"{workload['metadata']['name']}-x7k2q"
    values = {"metadata.name": pod_name, f"metadata.labels['{JOB_NAME_LABEL}']": workload["metadata"]["name"]}
    assert field in values, f"{field}: not a downward-API field these tests know the value of"
    if field.startswith("metadata.labels"):
        assert workload["kind"] == "Job", f"{field}: only a Job's pods carry that label"
    return values[field]


def expand(words: list[str], container: dict[str, Any], workload: dict[str, Any]) -> list[str]:
    """``command``/``args`` as the kubelet runs them: ``$(VAR)`` is the value of the container's env
    ``VAR`` and ``$$`` a ``$``. An undefined ``$(VAR)`` is left as written by the kubelet: a
    failure here."""
    env = {}
    for var in container.get("env", []):
        env[var["name"]] = var["value"] if "value" in var else downward(var["valueFrom"]["fieldRef"]["fieldPath"], workload)

    def one_ref(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        assert match.group(1) in env, f"{container['name']}: $({match.group(1)}) is not in its env"
        return env[match.group(1)]

    return [re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)", one_ref, word) for word in words]


def argv(name: str, docs: list[tuple[str, dict[str, Any]]] = MANIFESTS) -> list[str]:
    """The expanded ``command + args`` of the container ``name``."""
    [(workload, container)] = [(w, c) for w, _, c in containers(docs) if c["name"] == name]
    return expand([*container.get("command", []), *container.get("args", [])], container, workload)


def option(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def validate(doc: dict[str, Any]) -> None:
    """Against Kubernetes' schema for its kind, or the PodMonitor CRD's subset; raises on a fault."""
    if doc["apiVersion"] == "monitoring.coreos.com/v1":
        jsonschema.Draft202012Validator(json.loads(PODMONITOR_SCHEMA.read_text())).validate(doc)
    else:
        kubernetes_validate.validate(doc, KUBERNETES, strict=True)


@pytest.mark.parametrize("doc", [doc for _, doc in MANIFESTS + BUCKET_MANIFESTS],
                         ids=[f"{f}: {d['kind']}/{d['metadata']['name']}" for f, d in MANIFESTS + BUCKET_MANIFESTS])
def test_every_manifest_validates(doc: dict[str, Any]) -> None:
    validate(doc)


def test_a_misspelled_field_fails_validation() -> None:
    """Strict validation of both kinds: the test above can fail."""
    job = copy.deepcopy(one("Job"))
    job["spec"]["template"]["spec"]["initContainers"][0]["securityContext"]["readOnlyRootFilesytem"] = True
    monitor = copy.deepcopy(one("PodMonitor"))
    monitor["spec"]["podMetricsEndpoints"][0]["intervall"] = "30s"
    bad_interval = copy.deepcopy(one("PodMonitor"))
    bad_interval["spec"]["podMetricsEndpoints"][0]["interval"] = "30 seconds"
    for doc in (job, monitor, bad_interval):
        with pytest.raises(jsonschema.ValidationError):
            validate(doc)


def test_the_kustomization_lists_every_manifest_and_image() -> None:
    kustomization = yaml.safe_load((DEPLOY / "kustomization.yaml").read_text())
    assert kustomization["kind"] == "Kustomization"
    assert sorted(kustomization["resources"]) == sorted({file for file, _ in MANIFESTS})
    assert {c["image"] for _, _, c in containers()} == {image["name"] for image in kustomization["images"]}


def test_every_sidecar_command_parses_and_configures() -> None:
    """Each ``mstb-sidecar`` container's command as the CLI reads it: a renamed option fails here."""
    commands = {args[1]: args for args in (argv(c["name"]) for _, _, c in containers()) if args[0] == "mstb-sidecar"}
    assert set(commands) == {"--watch", "aggregate"}  # the node sidecar and the job aggregate
    for args in commands.values():
        assert "$(" not in " ".join(args), args  # no reference left unexpanded
        config = configure(args[1:])
        assert config.out == Path("/tensorboard/llama-pretrain") and config.job == "llama-pretrain"
    assert configure(commands["--watch"][1:]).instance == "llama-pretrain-x7k2q"  # the pod's name


def test_docs_kubernetes_shows_the_manifests_commands() -> None:
    """docs/kubernetes.md's ``mstb-sidecar`` commands are the containers' commands as written."""
    shown = sorted(args for doc, args, _ in COMMANDS if doc == "docs/kubernetes.md")
    written = sorted([*c["command"][1:], *c["args"]] for _, _, c in [*containers(), *containers(BUCKET_MANIFESTS)]
                     if c["command"][0] == "mstb-sidecar")
    assert shown == written


def test_the_tensorboard_command_is_one_tensorboard_takes() -> None:
    from tensorboard import program

    args = argv("tensorboard")
    assert args[0] == "tensorboard"
    board = program.TensorBoard()
    board.configure(argv=args)  # exits on an unknown flag
    assert board.flags.logdir == "/tensorboard" and board.flags.port == 6006


def test_the_sidecar_is_a_native_sidecar_of_the_training_job() -> None:
    """In ``initContainers`` with ``restartPolicy: Always``: it starts before the trainer and the
    kubelet stops it when the trainer exits, so the Job completes. As a second entry of
    ``containers`` it would keep the pod, and the Job, running after training ends."""
    template = one("Job")["spec"]["template"]["spec"]
    assert template["restartPolicy"] in ("Never", "OnFailure")
    assert [(c["name"], c.get("restartPolicy")) for c in template["initContainers"]] == [("mstb-sidecar", "Always")]
    assert [c["name"] for c in template["containers"]] == ["trainer"]


def test_the_sidecar_reads_the_trainers_output_and_writes_to_the_shared_volume() -> None:
    pod = one("Job")["spec"]["template"]["spec"]
    sidecar, trainer = by_name("mstb-sidecar"), by_name("trainer")
    [output] = [m for m in trainer["volumeMounts"] if m["mountPath"] == f"{trainer['workingDir']}/output"]
    [watched] = [m for m in sidecar["volumeMounts"] if m["name"] == output["name"]]
    assert option(argv("mstb-sidecar"), "--watch") == watched["mountPath"] and watched.get("readOnly")
    assert "emptyDir" in next(v for v in pod["volumes"] if v["name"] == output["name"])

    def claim_mount(container: dict[str, Any], template: dict[str, Any]) -> str:
        volumes = {v["name"]: v for v in template["spec"]["volumes"]}
        [mount] = [m for m in container["volumeMounts"] if "persistentVolumeClaim" in volumes[m["name"]]]
        assert volumes[mount["name"]]["persistentVolumeClaim"]["claimName"] == one("PersistentVolumeClaim")["metadata"]["name"]
        return mount["mountPath"]

    mounts = {c["name"]: claim_mount(c, t) for _, t, c in containers() if c["image"] == "mstb-sidecar"}
    assert option(argv("mstb-sidecar"), "--out") == f"{mounts['mstb-sidecar']}/llama-pretrain"
    assert option(argv("aggregate"), "--out") == option(argv("mstb-sidecar"), "--out")  # the job's directory
    assert option(argv("tensorboard"), "--logdir") == mounts["tensorboard"]
    assert one("PersistentVolumeClaim")["spec"]["accessModes"] == ["ReadWriteMany"]  # pods on several nodes


def test_prometheus_finds_the_metrics_port() -> None:
    """The port the sidecar serves, its container port, the annotations and the PodMonitor agree."""
    args, template = argv("mstb-sidecar"), one("Job")["spec"]["template"]
    [port] = by_name("mstb-sidecar")["ports"]
    assert int(option(args, "--metrics-port")) == port["containerPort"] == int(template["metadata"]["annotations"]["prometheus.io/port"])
    assert option(args, "--metrics-host") == "0.0.0.0"  # reachable from outside the pod
    assert template["metadata"]["annotations"]["prometheus.io/scrape"] == "true"
    monitor = one("PodMonitor")["spec"]
    assert monitor["selector"]["matchLabels"].items() <= template["metadata"]["labels"].items()
    [endpoint] = monitor["podMetricsEndpoints"]
    assert endpoint["port"] == port["name"]
    assert endpoint["path"] == template["metadata"]["annotations"]["prometheus.io/path"] == "/metrics"
    probes = [by_name("mstb-sidecar")[p]["httpGet"] for p in ("readinessProbe", "livenessProbe")]
    assert [(p["path"], p["port"]) for p in probes] == [("/readyz", "metrics"), ("/healthz", "metrics")]


def test_the_job_aggregate_is_one_writer() -> None:
    """It checkpoints as instance ``job``: one pod at a time, also during a rollout; and the node
    sidecars leave the aggregate to it, so the band chart draws one mean (docs/many-ranks.md)."""
    deployment = one("Deployment", "mstb-aggregate-llama-pretrain")["spec"]
    assert deployment["replicas"] == 1 and deployment["strategy"]["type"] == "Recreate"
    assert configure(argv("mstb-sidecar")[1:]).aggregate is False


@pytest.mark.parametrize("docs", [MANIFESTS, BUCKET_MANIFESTS], ids=["shared-volume", "object-storage"])
@pytest.mark.parametrize("name", sorted({c["name"] for _, _, c in containers() if c["image"] == "mstb-sidecar"}))
def test_every_container_of_the_image_is_hardened_and_sized(name: str, docs: list[tuple[str, dict[str, Any]]]) -> None:
    [(template, container)] = [(t, c) for _, t, c in containers(docs) if c["name"] == name]
    assert {k: container["securityContext"].get(k) for k in HARDENED} == HARDENED
    resources = container["resources"]
    assert set(resources["requests"]) == set(resources["limits"]) == {"cpu", "memory"}
    assert template["spec"]["securityContext"]["runAsUser"] == dockerfile_user()  # the image's user, not root


def _dockerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, its arguments) of the Dockerfile, comments and continuations handled."""
    text = re.sub(r"\\\n", " ", (DEPLOY / "Dockerfile").read_text())
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1].strip())
            for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def dockerfile_user() -> int:
    [user] = [args for instr, args in _dockerfile() if instr == "USER"]
    assert re.fullmatch(r"\d+(:\d+)?", user), "numeric, or the kubelet cannot check runAsNonRoot"
    return int(user.split(":")[0])


def test_the_dockerfile_installs_the_package_and_runs_its_console_script() -> None:
    """A lint (``docker build`` cannot run here): it copies what ``pip install`` of pyproject.toml
    needs (the packages it finds, the readme it names), installs that, and its ENTRYPOINT and the
    manifests' commands are console scripts that install provides."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    steps = _dockerfile()
    [base] = [args for instr, args in steps if instr == "FROM"]
    python = re.fullmatch(r"python:(\d+)\.(\d+)-slim", base)
    assert python and (int(python[1]), int(python[2])) >= (3, 10), base  # requires-python >=3.10
    assert project["project"]["requires-python"] == ">=3.10"
    copied = {src for instr, args in steps if instr == "COPY" for src in args.split()[:-1]}
    packages = {p.rstrip("*") for p in project["tool"]["setuptools"]["packages"]["find"]["include"]}
    assert copied == {"pyproject.toml", project["project"]["readme"], *packages}
    assert all((ROOT / src).exists() for src in copied)
    assert any(instr == "RUN" and "pip install" in args and "/src" in args for instr, args in steps)
    [entrypoint] = [json.loads(args) for instr, args in steps if instr == "ENTRYPOINT"]
    scripts = set(project["project"]["scripts"])
    scripts |= {ep.name for ep in distribution("tensorboard").entry_points if ep.group == "console_scripts"}
    assert any(dep.startswith("tensorboard") for dep in project["project"]["dependencies"])
    assert entrypoint == ["mstb-sidecar"] and "mstb-sidecar" in project["project"]["scripts"]
    assert {c["command"][0] for _, _, c in containers() if c["image"] == "mstb-sidecar"} <= scripts


def test_the_sidecar_container_command_follows_a_training(tmp_path: Path) -> None:
    """The manifest's sidecar command, with /job/output, /tensorboard and the port moved here, on
    the bundled mindformers 1.9 logs: every rank's loss at mindformers' values, the metrics with
    the job's label, and SIGTERM (what the kubelet sends when the trainer exits) ends it with 0."""
    output, board, port = tmp_path / "job" / "output", tmp_path / "tensorboard", free_port()
    shutil.copytree(EXAMPLE / "output", output)
    moved = {"/job/output": str(output), "/tensorboard": str(board), "9400": str(port)}
    args = [re.sub(r"^(/job/output|/tensorboard)(?=/|$)|^9400$", lambda m: moved[m[0]], a) for a in argv("mstb-sidecar")]
    assert args[0] == "mstb-sidecar" and args != argv("mstb-sidecar")
    out = Path(option(args, "--out"))
    truth = load_truth(EXAMPLE / "tensorboard_truth.json")
    with open(tmp_path / "stderr", "wb") as err:
        proc = subprocess.Popen([str(BIN), *args[1:]], stdin=subprocess.DEVNULL, stdout=err, stderr=err)
    try:
        def written() -> bool:
            return all((out / rank).is_dir() and len(scalars(out / rank).get("loss", {})) == 200 for rank in truth)

        wait_until(lambda: proc.poll() is not None or written(), 60, "both ranks' 200 steps")
        assert proc.poll() is None, (tmp_path / "stderr").read_text()
        scraped = wait_until(lambda: metrics(port), 10, "/metrics to answer")
        for rank, tags in truth.items():
            loss = scalars(out / rank)["loss"]
            assert all(loss[step] == pytest.approx(value, rel=1e-6) for step, value in tags["loss"].items())
            last = max(tags["loss"])
            number = rank.removeprefix("rank_")
            assert scraped[("mstb_sidecar_training_step", (("rank", number),))] == last
            assert scraped[("mstb_sidecar_training_loss", (("rank", number),))] == pytest.approx(tags["loss"][last], rel=1e-6)
        text = urlopen_text(f"http://127.0.0.1:{port}/metrics")
        assert 'training_job="llama-pretrain"' in text
        rss_kib = peak_rss_kib(proc.pid)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0, (tmp_path / "stderr").read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert rss_kib < 512 * 1024  # the container's memory limit
    print(f"peak RSS of the sidecar on the 2-rank example: {rss_kib / 1024:.0f} MiB")


def urlopen_text(url: str) -> str:
    from urllib.request import urlopen

    with urlopen(url, timeout=5) as resp:
        return resp.read().decode()


def peak_rss_kib(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"^VmHWM:\s+(\d+) kB", status, re.M)[1])


# -- object-storage/: the same job with its runs in a bucket ------------------------------------------


def test_the_object_storage_kustomization_lists_every_manifest_and_image() -> None:
    kustomization = yaml.safe_load((BUCKET_DIR / "kustomization.yaml").read_text())
    assert sorted(kustomization["resources"]) == sorted({file for file, _ in BUCKET_MANIFESTS})
    assert {c["image"] for _, _, c in containers(BUCKET_MANIFESTS)} == {i["name"] for i in kustomization["images"]}


def test_the_object_storage_commands_write_to_one_bucket_prefix_staged_in_a_writable_volume() -> None:
    """Each ``mstb-sidecar`` command parses and configures with ``--out s3://``; the node sidecars and
    the aggregate share the job's prefix, TensorBoard reads the bucket; each stages in a volume of
    its own pod (the root filesystem is read-only), and nothing mounts the shared claim."""
    bucket = {"mstb-sidecar": "", "aggregate": ""}
    for name in bucket:
        args = argv(name, BUCKET_MANIFESTS)
        config = configure(args[1:])
        bucket[name] = str(config.bucket)
        [(template, container)] = [(t, c) for _, t, c in containers(BUCKET_MANIFESTS) if c["name"] == name]
        volumes = {v["name"]: v for v in template["spec"]["volumes"]}
        [state] = [m for m in container["volumeMounts"] if m["mountPath"] == str(config.out)]
        assert "emptyDir" in volumes[state["name"]] and not state.get("readOnly")
        assert config.job == "llama-pretrain"
    assert bucket["mstb-sidecar"] == bucket["aggregate"] == "s3://mstb-runs/llama-pretrain"
    assert configure(argv("mstb-sidecar", BUCKET_MANIFESTS)[1:]).instance == "llama-pretrain-x7k2q"
    logdir = option(argv("tensorboard", BUCKET_MANIFESTS), "--logdir")
    assert bucket["aggregate"].startswith(logdir + "/")
    assert not [doc for _, doc in BUCKET_MANIFESTS if doc["kind"] == "PersistentVolumeClaim"]


def test_the_object_storage_credentials_come_from_the_secret() -> None:
    """Every container that talks to the bucket has the endpoint TensorBoard reads (``S3_ENDPOINT``)
    and takes the Secret's keys, which are the ones boto3 reads; no key is written in a container."""
    [secret] = [doc for _, doc in BUCKET_MANIFESTS if doc["kind"] == "Secret"]
    assert set(secret["stringData"]) == {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"}
    talking = [c for _, _, c in containers(BUCKET_MANIFESTS) if c["image"] == "mstb-sidecar"]
    assert sorted(c["name"] for c in talking) == ["aggregate", "mstb-sidecar", "tensorboard"]
    endpoints = set()
    for container in talking:
        assert container["envFrom"] == [{"secretRef": {"name": secret["metadata"]["name"]}}], container["name"]
        env = {var["name"]: var.get("value") for var in container["env"]}
        assert not set(env) & set(secret["stringData"]), container["name"]
        endpoints.add(env["S3_ENDPOINT"])
    assert len(endpoints) == 1  # the sidecars write where TensorBoard reads


def test_the_object_storage_tensorboard_command_is_one_tensorboard_takes() -> None:
    from tensorboard import program

    board = program.TensorBoard()
    board.configure(argv=argv("tensorboard", BUCKET_MANIFESTS))
    assert board.flags.logdir == "s3://mstb-runs"


def _tomllib_imports(path: Path) -> tuple[int, int]:
    """(imports of tomllib in the file, those of them in a ``try`` whose handler imports tomli)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))

    def imports(nodes: list[ast.stmt], name: str) -> int:
        return sum(isinstance(n, ast.Import) and any(a.name == name for a in n.names) or
                   isinstance(n, ast.ImportFrom) and n.module == name for node in nodes for n in ast.walk(node))

    guarded = sum(imports(node.body, "tomllib") for node in ast.walk(tree) if isinstance(node, ast.Try)
                  and any(imports(handler.body, "tomli") for handler in node.handlers))
    return imports(tree.body, "tomllib"), guarded


def test_the_tests_run_on_the_oldest_python_the_project_declares() -> None:
    """``requires-python`` is >=3.10, whose standard library has no ``tomllib`` (3.11): every import
    of it falls back to ``tomli``, which the test extra installs on 3.10 (and only there)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert project["project"]["requires-python"] == ">=3.10"
    [tomli] = [r for r in map(Requirement, project["project"]["optional-dependencies"]["test"]) if r.name == "tomli"]
    assert tomli.marker is not None and tomli.marker.evaluate({"python_version": "3.10"})
    assert not tomli.marker.evaluate({"python_version": "3.11"})
    sources = [p for pattern in ("sidecar/**/*.py", "parsers/**/*.py", "tests/*.py", "bench/*.py", "scripts/*.py")
               for p in ROOT.glob(pattern)]
    unguarded = {str(p.relative_to(ROOT)): n for p in sources for n, guarded in [_tomllib_imports(p)] if n != guarded}
    assert not unguarded, f"imports of tomllib without the tomli fallback: {unguarded}"
    assert _tomllib_imports(Path(__file__)) == (1, 1)

