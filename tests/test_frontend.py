"""vLLM's frontend flags end to end: HTTPS to the OpenAI SDK (a certificate made here), client certificates
required, a unix socket, CORS preflights for listed origins only, a root path behind a prefixing proxy, the docs
pages off, and each flag's mistakes refused naming it."""

import datetime
import os
import ssl
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from fastapi.testclient import TestClient
from openai import OpenAI

from checkpoints import build_bert
from ember.api.app import create_app
from ember.config import EngineConfig, ServerConfig
from ember.engine.engine import AsyncEngine
from server import free_port

ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "EMBER_NATIVE_ATTENTION": "0", "EMBER_NATIVE_INT8": "0",
       "EMBER_NATIVE_ELEMENTWISE": "0", "EMBER_NATIVE_LINEAR": "0",
       "EMBER_NATIVE_LINEAR_F32": "0", "EMBER_NATIVE_LINEAR_BF16": "0"}  # fmt: skip


def _key_and_cert(subject: str, issuer_key=None, issuer=None, ca=False, san=None):
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)])
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(issuer or name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if san:
        builder = builder.add_extension(x509.SubjectAlternativeName(san), critical=False)
    cert = builder.sign(issuer_key or key, hashes.SHA256())
    return key, cert


def _write(path: Path, key, cert) -> tuple[str, str]:
    key_path, cert_path = path.with_suffix(".key"), path.with_suffix(".pem")
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))  # fmt: skip
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return str(key_path), str(cert_path)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    import ipaddress

    root = tmp_path_factory.mktemp("pki")
    ca_key, ca_cert = _key_and_cert("ember test CA", ca=True)
    san = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    server = _write(root / "server", *_key_and_cert("localhost", ca_key, ca_cert.subject, san=san))
    client = _write(root / "client", *_key_and_cert("a client", ca_key, ca_cert.subject))
    _, ca = _write(root / "ca", ca_key, ca_cert)
    return {"server": server, "client": client, "ca": ca}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_bert(tmp_path_factory.mktemp("bert") / "m", layers=1, hidden=32)


def _serve(model, args, log, ready):
    proc = subprocess.Popen([sys.executable, "-m", "ember.cli.main", "serve", str(model), "--enforce-eager",
                             "--shutdown-grace", "2", *args],
                            env=ENV, stdout=log.open("wb"), stderr=subprocess.STDOUT)  # fmt: skip
    for _ in range(450):
        if proc.poll() is not None:
            raise RuntimeError(log.read_text())
        try:
            if ready():
                return proc
        except (httpx.HTTPError, OSError):
            pass
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"not ready:\n{log.read_text()}")


def test_https_serves_the_openai_sdk_and_can_require_client_certificates(model, pki, tmp_path):
    port = free_port()
    key, cert = pki["server"]
    url = f"https://127.0.0.1:{port}"
    args = ["--port", str(port), "--host", "127.0.0.1", "--ssl-keyfile", key, "--ssl-certfile", cert,
            "--ssl-ca-certs", pki["ca"], "--ssl-cert-reqs", "2"]  # fmt: skip
    context = ssl.create_default_context(cafile=pki["ca"])
    context.load_cert_chain(pki["client"][1], pki["client"][0])
    trusted = httpx.Client(verify=context)
    proc = _serve(model, args, tmp_path / "log", lambda: trusted.get(url + "/health").status_code == 200)
    try:
        sdk = OpenAI(base_url=url + "/v1", api_key="unused", http_client=trusted)
        out = sdk.embeddings.create(model=str(model), input=["over TLS"])
        assert len(out.data[0].embedding) == 32
        with pytest.raises(httpx.HTTPError):  # no client certificate: the handshake is refused
            httpx.get(url + "/health", verify=ssl.create_default_context(cafile=pki["ca"]))
        with pytest.raises(httpx.HTTPError):  # plain HTTP on the TLS port
            httpx.get(f"http://127.0.0.1:{port}/health")
        assert (
            "serving" in (tmp_path / "log").read_text()
            and f"https://127.0.0.1:{port}" in (tmp_path / "log").read_text()
        )
    finally:
        proc.terminate()
        proc.wait(60)


def test_a_unix_socket_serves_the_openai_sdk(model, tmp_path):
    sock = str(tmp_path / "ember.sock")
    client = httpx.Client(transport=httpx.HTTPTransport(uds=sock), base_url="http://ember")
    proc = _serve(model, ["--uds", sock], tmp_path / "log", lambda: client.get("/health").status_code == 200)
    try:
        sdk = OpenAI(base_url="http://ember/v1", api_key="unused", http_client=client)
        assert len(sdk.embeddings.create(model=str(model), input="by socket").data) == 1
    finally:
        proc.terminate()
        proc.wait(60)


def _app(runner, tokenizer, **kw):
    engine = AsyncEngine(runner, tokenizer, EngineConfig(), None)
    return create_app(engine, ServerConfig(served_model_names=("m",), api_keys=("k",)), **kw)


def test_cors_preflights_are_answered_for_listed_origins_only_before_the_key(runner, tokenizer):
    cors = {"allow_origins": ["https://app.example"], "allow_methods": ["*"], "allow_headers": ["*"],
            "allow_credentials": False, "expose_headers": ["x-request-id"]}  # fmt: skip
    with TestClient(_app(runner, tokenizer, cors=cors)) as c:
        ask = {"access-control-request-method": "POST", "access-control-request-headers": "authorization"}
        ok = c.options("/v1/embeddings", headers={"origin": "https://app.example", **ask})
        assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == "https://app.example"
        other = c.options("/v1/embeddings", headers={"origin": "https://evil.example", **ask})
        assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
        real = c.post("/v1/embeddings", json={"input": "x"}, headers={"origin": "https://app.example",
                                                                       "authorization": "Bearer k"})  # fmt: skip
        assert real.status_code == 200 and real.headers["access-control-allow-origin"] == "https://app.example"
    with TestClient(_app(runner, tokenizer)) as c:  # no --allowed-origins: no cross-origin answers at all
        r = c.options("/v1/embeddings", headers={"origin": "https://app.example", **ask})
        assert "access-control-allow-origin" not in r.headers


def test_a_root_path_keeps_docs_working_behind_a_prefixing_proxy_and_docs_can_be_off(runner, tokenizer):
    with TestClient(_app(runner, tokenizer), root_path="/ember") as c:
        page = c.get("/docs")
        assert page.status_code == 200 and "/ember/openapi.json" in page.text
        assert c.get("/openapi.json").status_code == 200
    with TestClient(_app(runner, tokenizer, docs=False)) as c:
        assert c.get("/docs").status_code == 404 and c.get("/openapi.json").status_code == 404


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--ssl-keyfile", "/nonexistent.key", "--ssl-certfile", "/nonexistent.pem"],
            "--ssl-keyfile /nonexistent.key: no such file",
        ),
        (["--allowed-origins", "https://app.example"], "--allowed-origins takes a JSON list"),
        (["--ssl-cert-reqs", "5"], "--ssl-cert-reqs is 0"),
    ],
)
def test_frontend_mistakes_are_refused_naming_the_flag(argv, message):
    done = subprocess.run([sys.executable, "-m", "ember.cli.main", "serve", *argv], capture_output=True, text=True,
                          env=ENV, timeout=300)  # fmt: skip
    assert done.returncode == 2 and message in done.stderr, done.stderr


def test_behind_a_root_path_the_key_is_still_checked_and_metrics_name_the_route(runner, tokenizer):
    # uvicorn with --root-path gives the app scope["path"] with the prefix in it (as here) and root_path beside it
    with TestClient(_app(runner, tokenizer), root_path="/ember") as c:
        assert c.post("/ember/v1/embeddings", json={"input": "x"}).status_code == 401
        ok = c.post("/ember/v1/embeddings", json={"input": "x"}, headers={"authorization": "Bearer k"})
        assert ok.status_code == 200
        assert 'endpoint="/v1/embeddings",status="401"' in c.get("/ember/metrics").text
