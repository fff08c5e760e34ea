"""Credentials for a secure Flower deployment of fedsim (docs/deployment.md): TLS certificates for the
SuperLink and an authentication key pair per SuperNode, made with ``cryptography``.

    python scripts/deploy_credentials.py DIR --host 127.0.0.1 --host superlink.example.org \
        --node node0 --node node1 --node node2

writes into DIR (private keys readable by the owner only):

* ``ca.pem`` / ``ca.key`` - a private certificate authority (P-384, valid ``--days``). ``ca.pem`` goes to
  every SuperNode (``--root-certificates``) and to the ``flwr`` CLI (``root-certificates``); ``ca.key``
  only signs, keep it offline;
* ``server.pem`` / ``server.key`` - the SuperLink's TLS certificate for every ``--host`` (IP addresses
  and DNS names, as the SuperNodes will dial it), signed by the CA (``--ssl-certfile``,
  ``--ssl-keyfile``; ``--ssl-ca-certfile ca.pem``);
* ``<node>.key`` / ``<node>.pub`` - one SuperNode's authentication key pair (EC P-384, OpenSSH format, as
  Flower 1.42 reads them): the private key stays on that node (``--auth-supernode-private-key``), the
  public key is registered with the SuperLink (``flwr supernode register <node>.pub <connection>``).

A real deployment may use its organisation's CA instead; the SuperNode keys are what Flower's node
authentication needs either way. ``tests/test_deployment.py`` uses :func:`make_credentials`.
"""
from __future__ import annotations

import argparse
import datetime
import ipaddress
import os
from pathlib import Path
from typing import Sequence

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


def _write(path: Path, data: bytes, private: bool = False) -> Path:
    path.write_bytes(data)
    if private:
        os.chmod(path, 0o600)
    return path


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _san(host: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host)


def make_credentials(out: str | Path, hosts: Sequence[str] = ("127.0.0.1", "localhost"),
                     nodes: Sequence[str] = ("node0",), days: int = 365) -> dict[str, Path]:
    """Write the CA, the SuperLink's certificate for ``hosts`` and a key pair per node name into ``out``;
    returns the paths by name (``ca``, ``server_cert``, ``server_key``, ``<node>.key``, ``<node>.pub``)."""
    if not hosts:
        raise ValueError("give at least one host name or IP address the SuperNodes dial")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc)
    start, end = now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=days)
    pem, no_password = serialization.Encoding.PEM, serialization.NoEncryption()

    ca_key = ec.generate_private_key(ec.SECP384R1())
    ca_name = _name("fedsim deployment CA")
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(start).not_valid_after(end)
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                       content_commitment=False, key_encipherment=False, data_encipherment=False,
                                       key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
          .sign(ca_key, hashes.SHA384()))
    key = ec.generate_private_key(ec.SECP384R1())
    cert = (x509.CertificateBuilder().subject_name(_name(hosts[0])).issuer_name(ca_name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(start).not_valid_after(end)
            .add_extension(x509.SubjectAlternativeName([_san(h) for h in hosts]), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .sign(ca_key, hashes.SHA384()))
    paths = {
        "ca": _write(out / "ca.pem", ca.public_bytes(pem)),
        "ca_key": _write(out / "ca.key", ca_key.private_bytes(pem, serialization.PrivateFormat.PKCS8, no_password),
                         private=True),
        "server_cert": _write(out / "server.pem", cert.public_bytes(pem)),
        "server_key": _write(out / "server.key", key.private_bytes(pem, serialization.PrivateFormat.PKCS8,
                                                                    no_password), private=True),
    }
    for node in nodes:
        node_key = ec.generate_private_key(ec.SECP384R1())
        paths[f"{node}.key"] = _write(out / f"{node}.key", node_key.private_bytes(
            pem, serialization.PrivateFormat.OpenSSH, no_password), private=True)
        paths[f"{node}.pub"] = _write(out / f"{node}.pub", node_key.public_key().public_bytes(
            serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH))
    return paths


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", help="folder to write the certificates and keys into")
    p.add_argument("--host", action="append", help="a host name or IP address of the SuperLink (repeatable; "
                   "default 127.0.0.1 and localhost)")
    p.add_argument("--node", action="append", help="a SuperNode's name: one key pair each (repeatable; default node0)")
    p.add_argument("--days", type=int, default=365, help="validity of the certificates (default 365)")
    args = p.parse_args(argv)
    paths = make_credentials(args.out, args.host or ("127.0.0.1", "localhost"), args.node or ("node0",), args.days)
    for name, path in paths.items():
        print(f"{name:<14} {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
