"""A secured etcd for tests: certificates made with openssl (a CA, a server certificate for loopback, a
client certificate) and etcd users/roles set up with etcdctl.

The same commands are in docs/guides/etcd.md (multi-node etcd with TLS and auth).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Certs:
    ca: str
    server_cert: str
    server_key: str
    client_cert: str
    client_key: str
    other_ca: str
    """A CA that signed nothing here: trusting it must fail the handshake."""


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def _ca(name: str, cwd: Path) -> None:
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", f"{name}.key", "-out", f"{name}.pem", "-days", "2", "-subj", f"/CN={name}", cwd=cwd)  # fmt: skip


def _signed(name: str, ext: str, cwd: Path) -> None:
    _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}", cwd=cwd)  # fmt: skip
    (cwd / f"{name}.ext").write_text(ext)
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
             "-out", f"{name}.pem", "-days", "2", "-extfile", f"{name}.ext", cwd=cwd)  # fmt: skip


def make_certs(directory: Path) -> Certs | None:
    """Write the certificates into ``directory``; None when openssl is not installed."""
    if shutil.which("openssl") is None:
        return None
    _ca("ca", directory)
    _ca("other-ca", directory)
    _signed("server", "subjectAltName=IP:127.0.0.1,IP:::1,DNS:localhost\nextendedKeyUsage=serverAuth\n", directory)
    _signed("client", "extendedKeyUsage=clientAuth\n", directory)
    d = str(directory)
    return Certs(
        ca=f"{d}/ca.pem", server_cert=f"{d}/server.pem", server_key=f"{d}/server.key",
        client_cert=f"{d}/client.pem", client_key=f"{d}/client.key", other_ca=f"{d}/other-ca.pem",
    )  # fmt: skip


USER, PASSWORD = "trainer", "tr41ner-pw"
"""The non-root etcd user the tests' jobs run as: read/write under /spotrun/ only."""


def etcdctl_path() -> str | None:
    from elastic.etcd_server import find_etcd_binary

    candidate = os.path.join(os.path.dirname(find_etcd_binary()), "etcdctl")
    return candidate if os.access(candidate, os.X_OK) else shutil.which("etcdctl")


def enable_auth(etcdctl: str, endpoint: str, certs: Certs | None = None) -> None:
    """root user, a role for /spotrun/, the user ``USER`` with it, then ``auth enable`` (as docs/guides/etcd.md says)."""
    tls = [f"--cacert={certs.ca}", f"--cert={certs.client_cert}", f"--key={certs.client_key}"] if certs else []
    scheme = "https" if certs else "http"

    def ctl(*args: str) -> None:
        subprocess.run([etcdctl, f"--endpoints={scheme}://{endpoint}", *tls, *args],
                       env=dict(os.environ, ETCDCTL_API="3"), check=True, capture_output=True, timeout=30)  # fmt: skip

    ctl("user", "add", "root:r00t-pw", "--interactive=false")
    ctl("user", "grant-role", "root", "root")
    ctl("role", "add", "spotrun")
    ctl("role", "grant-permission", "spotrun", "--prefix=true", "readwrite", "/spotrun/")
    ctl("user", "add", f"{USER}:{PASSWORD}", "--interactive=false")
    ctl("user", "grant-role", USER, "spotrun")
    ctl("auth", "enable")
