"""A redis-server that speaks only TLS, and the certificates it needs, for tests.

:func:`make_certificates` writes, with the ``openssl`` command line, a self-signed CA, a server
certificate for 127.0.0.1/localhost and a client certificate signed by it, plus an unrelated
second CA (to see verification fail). :class:`TLSRedisServer` listens on a TLS port only
(``--port 0``); with ``client_auth=True`` it requires a client certificate (mutual TLS).

Run it from the repository root: ``python -m tests.support.tls [--mtls]`` starts one, prints
its URL and certificate paths and runs until Ctrl-C.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from tests.support.servers import RedisServer, find_redis_server

__all__ = ["Certificates", "make_certificates", "TLSRedisServer", "redis_has_tls"]


@dataclass(frozen=True)
class Certificates:
    """Paths of the PEM files :func:`make_certificates` wrote."""

    directory: Path
    ca_cert: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    other_ca_cert: Path  # a CA that signed neither certificate


def _openssl(*args: str, cwd: Path) -> None:
    proc = subprocess.run(
        ["openssl", *args],
        cwd=cwd,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=60,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"openssl {' '.join(args)} failed:\n{proc.stderr}")


def _new_ca(directory: Path, name: str, cn: str) -> None:
    _openssl(
        "req",
        "-x509",
        "-new",
        "-nodes",
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:prime256v1",
        "-sha256",
        "-days",
        "2",
        "-subj",
        f"/CN={cn}",
        "-keyout",
        f"{name}.key",
        "-out",
        f"{name}.crt",
        # What strict X.509 verification (Python 3.13's default) asks of a CA.
        "-addext",
        "basicConstraints=critical,CA:TRUE",
        "-addext",
        "keyUsage=critical,keyCertSign,cRLSign",
        "-addext",
        "subjectKeyIdentifier=hash",
        cwd=directory,
    )


def _signed(directory: Path, name: str, cn: str, usage: str, ca: str = "ca") -> None:
    _openssl(
        "req",
        "-new",
        "-nodes",
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:prime256v1",
        "-subj",
        f"/CN={cn}",
        "-keyout",
        f"{name}.key",
        "-out",
        f"{name}.csr",
        cwd=directory,
    )
    ext = directory / f"{name}.ext"
    ext.write_text(
        "basicConstraints=CA:FALSE\n"
        "keyUsage=digitalSignature,keyEncipherment\n"
        f"extendedKeyUsage={usage}\n"
        "subjectAltName=IP:127.0.0.1,DNS:localhost\n"
        "subjectKeyIdentifier=hash\n"
        "authorityKeyIdentifier=keyid,issuer\n"
    )
    _openssl(
        "x509",
        "-req",
        "-in",
        f"{name}.csr",
        "-CA",
        f"{ca}.crt",
        "-CAkey",
        f"{ca}.key",
        "-CAcreateserial",
        "-days",
        "2",
        "-sha256",
        "-extfile",
        ext.name,
        "-out",
        f"{name}.crt",
        cwd=directory,
    )


def make_certificates(directory: str | os.PathLike | None = None) -> Certificates:
    """A CA, a server and a client certificate signed by it, and a second CA, as PEM files
    in ``directory`` (a new temporary one when None). Keys are P-256, valid two days."""
    if shutil.which("openssl") is None:
        raise RuntimeError("the openssl command line tool is needed to make test certificates")
    path = Path(directory) if directory else Path(tempfile.mkdtemp(prefix="steplock-tls-"))
    path.mkdir(parents=True, exist_ok=True)
    _new_ca(path, "ca", "celery-steplock test CA")
    _new_ca(path, "other-ca", "an unrelated CA")
    _signed(path, "server", "127.0.0.1", "serverAuth")
    _signed(path, "client", "steplock-client", "clientAuth")
    return Certificates(
        directory=path,
        ca_cert=path / "ca.crt",
        server_cert=path / "server.crt",
        server_key=path / "server.key",
        client_cert=path / "client.crt",
        client_key=path / "client.key",
        other_ca_cert=path / "other-ca.crt",
    )


def redis_has_tls() -> tuple[bool, str]:
    """Whether the redis-server binary the tests use was built with TLS: ``(ok, detail)``.
    Asks it to start with a TLS port and no certificate; a build without TLS refuses the
    option itself."""
    binary = find_redis_server()
    try:
        proc = subprocess.run(
            [binary, "--port", "0", "--tls-port", "0", "--save", "", "--daemonize", "no"],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return False, f"{binary}: {exc}"
    out = proc.stdout + proc.stderr
    if "not listen anywhere" in out:  # the options parsed: TLS is built in
        return True, binary
    return False, f"{binary}: {out.strip()[-300:]}"


class TLSRedisServer(RedisServer):
    """A redis-server on 127.0.0.1 that accepts TLS connections only (its :attr:`port` is
    the TLS port), with the server certificate of ``certs``; ``client_auth=True`` requires
    a client certificate signed by the CA (mutual TLS)."""

    def __init__(self, certs: Certificates, client_auth: bool = False, **kwargs):
        super().__init__(**kwargs)
        self.certs = certs
        self.client_auth = client_auth

    def __repr__(self) -> str:
        return f"<TLSRedisServer {self.url} pid={self.pid} mtls={self.client_auth}>"

    @property
    def url(self) -> str:
        return f"rediss://127.0.0.1:{self.port}/0"

    def client_kwargs(self, client_cert: bool = True) -> dict:
        """redis-py keyword arguments that verify the server against the CA (and present
        the client certificate when ``client_cert``)."""
        kwargs = {
            "ssl": True,
            "ssl_ca_certs": str(self.certs.ca_cert),
            "ssl_cert_reqs": "required",
        }
        if client_cert:
            kwargs.update(
                ssl_certfile=str(self.certs.client_cert), ssl_keyfile=str(self.certs.client_key)
            )
        return kwargs

    def _port_args(self) -> list[str]:
        return [
            "--port",
            "0",
            "--tls-port",
            str(self.port),
            "--tls-cert-file",
            str(self.certs.server_cert),
            "--tls-key-file",
            str(self.certs.server_key),
            "--tls-ca-cert-file",
            str(self.certs.ca_cert),
            "--tls-auth-clients",
            "yes" if self.client_auth else "no",
        ]

    def _probe_client(self):
        import redis

        return redis.Redis(
            host="127.0.0.1",
            port=self.port,
            socket_connect_timeout=0.5,
            socket_timeout=1.0,
            **self.client_kwargs(),
        )


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mtls", action="store_true", help="require client certificates")
    args = parser.parse_args(argv)
    certs = make_certificates()
    with TLSRedisServer(certs, client_auth=args.mtls) as server:
        print(
            server.url,
            f"ca={certs.ca_cert}",
            f"cert={certs.client_cert}",
            f"key={certs.client_key}",
            flush=True,
        )
        try:
            while server.alive():
                time.sleep(0.5)
        except KeyboardInterrupt:
            pass
    shutil.rmtree(certs.directory, ignore_errors=True)


if __name__ == "__main__":
    main()
