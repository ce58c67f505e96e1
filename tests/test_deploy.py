"""The deployment files in deploy/ as shipped: every command they run is one ember accepts, the probes hit routes
that exist, the limits and the grace fit together, the read-only root filesystem leaves ember what it writes, and
the LiteLLM config routes embeddings to a running ember."""

import argparse
import configparser
import re
import shlex
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


def _manifests() -> dict[str, dict]:
    docs = list(yaml.safe_load_all((DEPLOY / "kubernetes" / "ember.yaml").read_text()))
    return {d["kind"]: d for d in docs}


def test_the_kubernetes_deployment_is_consistent():
    m = _manifests()
    pod = m["Deployment"]["spec"]["template"]["spec"]
    [c] = pod["containers"]
    args = serve_args(c["command"])
    assert c["resources"]["requests"] == c["resources"]["limits"]  # Guaranteed QoS: ember sizes to the limit
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"]["path"] in _routes() and c[probe]["httpGet"]["port"] == "http"
    assert c["ports"][0]["containerPort"] == args.port
    pre_stop = int(c["lifecycle"]["preStop"]["exec"]["command"][1])
    assert pod["terminationGracePeriodSeconds"] >= pre_stop + args.shutdown_grace + 5
    assert m["Service"]["spec"]["selector"] == m["Deployment"]["spec"]["selector"]["matchLabels"]
    # a read-only root: the only place ember writes (torch.compile's cache, temp files) is a mounted volume
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    mounts = {v["mountPath"] for v in c["volumeMounts"]}
    assert "/tmp" in mounts
    dockerfile = (DEPLOY / "docker" / "Dockerfile").read_text()
    inductor = re.search(r"TORCHINDUCTOR_CACHE_DIR=(\S+)", dockerfile).group(1)
    assert any(inductor.startswith(m + "/") for m in mounts)


def test_the_dockerfile_bakes_the_kernels_and_serves_without_a_compiler():
    text = (DEPLOY / "docker" / "Dockerfile").read_text()
    build, runtime = text.split("\nFROM python:3.11-slim\n")
    assert "g++" in build and "ember build-kernels --cache-dir /opt/ember-kernels" in build
    assert "g++" not in runtime and "COPY --from=build /opt/ember-kernels /opt/ember-kernels" in runtime
    assert "EMBER_CACHE_DIR=/opt/ember-kernels" in runtime
    assert "download.pytorch.org/whl/cpu" in build  # never a CUDA torch
    cmd = re.search(r"^CMD (\[.*\])$", text, re.M).group(1)
    serve_args(yaml.safe_load(cmd))  # the exec form, a JSON list


def test_the_systemd_unit_runs_an_accepted_command_and_stops_within_its_grace():
    unit = configparser.ConfigParser(interpolation=None, strict=False)
    unit.read_string((DEPLOY / "systemd" / "ember.service").read_text())
    service = unit["Service"]
    args = serve_args(shlex.split(service["ExecStart"]))
    assert int(service["TimeoutStopSec"]) >= args.shutdown_grace + 5
    assert service["KillSignal"] == "SIGTERM" and service["Restart"] == "on-failure"


def test_the_compose_file_runs_accepted_commands():
    compose = yaml.safe_load((DEPLOY / "litellm" / "docker-compose.yaml").read_text())
    for name in ("ember", "ember-rerank"):
        serve_args(compose["services"][name]["command"])
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

    config = yaml.safe_load((DEPLOY / "litellm" / "config.yaml").read_text())
    modes = {m["model_name"]: m["model_info"]["mode"] for m in config["model_list"]}
    assert modes == {"all-minilm": "embedding", "bge-reranker": "rerank"}
    assert all(m["litellm_params"]["model"].startswith("hosted_vllm/") for m in config["model_list"])
    monkeypatch.setenv("EMBER_API_BASE", server.url + "/v1")
    monkeypatch.setenv("EMBER_RERANK_API_BASE", server.url)
    monkeypatch.setenv("EMBER_API_KEY", "k")
    router = litellm.Router(model_list=config["model_list"])
    out = router.embedding(model="all-minilm", input=["shipped config", "second text"])
    assert len(out.data) == 2 and len(out.data[0]["embedding"]) == 32
