"""A real S3 server for the object-store staging tests: versitygw on loopback.

Why a real server and not a mock: what staging depends on is the server's behaviour
(ListObjectsV2 pages, ranged GETs honouring If-Match, ETags, error codes on a missing
bucket or a bad key), which a mock would only repeat from our own reading of the spec.
versitygw is built once per machine from the Go module proxy
(scripts/install-s3-server.sh) and serves a temporary directory.

Without the binary and without Go, tests skip; CI sets S3_SERVER_REQUIRED=1 to turn
that skip into a failure. S3_SERVER_BIN points at a prebuilt binary instead.
"""

from __future__ import annotations

import os
import secrets
import socket
import subprocess
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import tools

REPO = Path(__file__).resolve().parent.parent
INSTALL = REPO / "scripts" / "install-s3-server.sh"


def server_binary() -> str:
    """$S3_SERVER_BIN, else the cached build (built now when missing and Go is here)."""
    explicit = os.environ.get("S3_SERVER_BIN")
    if explicit:
        if not os.access(explicit, os.X_OK):
            pytest.fail(f"S3_SERVER_BIN={explicit} is not an executable file")
        return explicit
    try:
        out = subprocess.run(["bash", str(INSTALL)], capture_output=True, text=True,
                             timeout=900, check=True)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError) as exc:
        tools.unavailable("S3_SERVER_REQUIRED", f"no S3 server: {INSTALL.name} failed: "
                 f"{getattr(exc, 'stderr', '') or exc}")
    return out.stdout.strip().splitlines()[-1]


@dataclass
class S3Server:
    """A running versitygw: ``url`` (http://127.0.0.1:PORT), the root user's keys, and
    ``root`` (the directory it serves: ``root/BUCKET/KEY``)."""

    url: str
    access_key: str
    secret_key: str
    root: Path
    proc: subprocess.Popen[bytes]

    def env(self, **extra: str) -> dict[str, str]:
        """The environment a client needs (the standard AWS variables)."""
        return {"AWS_ENDPOINT_URL_S3": self.url, "AWS_ACCESS_KEY_ID": self.access_key,
                "AWS_SECRET_ACCESS_KEY": self.secret_key, "AWS_REGION": "us-east-1",
                "AWS_EC2_METADATA_DISABLED": "true", **extra}

    def client(self) -> Any:
        import boto3
        from botocore.config import Config

        return boto3.session.Session().client(
            "s3", endpoint_url=self.url, aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key, region_name="us-east-1",
            config=Config(s3={"addressing_style": "path"}))

    def upload(self, directory: Path, bucket: str, prefix: str) -> None:
        """Every file under ``directory`` as ``prefix/<relative path>`` (created bucket)."""
        s3 = self.client()
        try:
            s3.create_bucket(Bucket=bucket)
        except s3.exceptions.BucketAlreadyOwnedByYou:
            pass
        for path in sorted(directory.rglob("*")):
            if path.is_file():
                key = f"{prefix.rstrip('/')}/{path.relative_to(directory).as_posix()}"
                s3.upload_file(str(path), bucket, key.lstrip("/"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def running(root: Path, log: Path):
    """Start versitygw over ``root`` on a free loopback port; stop it (by its PID) after."""
    binary = server_binary()
    root.mkdir(parents=True, exist_ok=True)
    access, secret = "csipmem" + secrets.token_hex(6), secrets.token_hex(20)
    port = _free_port()
    meta = root.parent / f"s3meta-{root.name}"  # not a prefix of root: versitygw checks
    meta.mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "VGW_"))}
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [binary, "--port", f"127.0.0.1:{port}", "--access", access, "--secret", secret,
             "--quiet", "posix", "--sidecar", str(meta), str(root)],
            stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 30
        while True:
            if proc.poll() is not None:
                pytest.fail(f"versitygw exited with {proc.returncode}: {log.read_text()}")
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    pytest.fail(f"versitygw did not listen within 30 s: {log.read_text()}")
                time.sleep(0.1)
        yield S3Server(f"http://127.0.0.1:{port}", access, secret, root, proc)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
