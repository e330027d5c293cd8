"""TLS keys and credentials of a run.

``shoal keys`` makes a run CA and one member certificate signed by it (EC P-256, both
``serverAuth`` and ``clientAuth``), so every channel is mutual TLS: a peer needs a
certificate of the run's CA to open a connection at all, and the join token and member
credentials travel only inside TLS. Users may bring their own CA, certificate and key.

Plain text exists only for loopback (``--insecure``): :func:`check_plaintext` refuses it
for any other address.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import re
from dataclasses import dataclass
from pathlib import Path

from shoal.errors import ShoalError

CA_FILE, CERT_FILE, KEY_FILE = "ca.pem", "member.pem", "member.key"
CA_KEY_FILE = "ca.key"
DEFAULT_HOSTS = ("localhost", "127.0.0.1", "::1")
VALID_DAYS = 365
_HOST_NAME = re.compile(r"[A-Za-z0-9]([A-Za-z0-9.-]*[A-Za-z0-9])?")


@dataclass(frozen=True)
class TlsConfig:
    """PEM bytes of a run's CA and of this member's certificate and key."""

    ca: bytes  # CA certificate(s) every peer's certificate must chain to
    cert: bytes  # this member's certificate chain (presented as server and as client)
    key: bytes  # this member's private key

    def server_credentials(self):
        """gRPC server credentials that also demand a client certificate of the CA."""
        import grpc

        return grpc.ssl_server_credentials([(self.key, self.cert)], root_certificates=self.ca,
                                           require_client_auth=True)

    def channel_credentials(self):
        """gRPC channel credentials: trust only the run CA, present our certificate."""
        import grpc

        return grpc.ssl_channel_credentials(root_certificates=self.ca, private_key=self.key,
                                            certificate_chain=self.cert)


def _read(path: Path, what: str, flag: str) -> bytes:
    if not path.is_file():
        raise ShoalError(f"{flag}: {what} {path} does not exist (make keys with `shoal keys --out DIR`)")
    data = path.read_bytes()
    if b"-----BEGIN" not in data:
        raise ShoalError(f"{flag}: {path} is not a PEM file; give the {what} in PEM form")
    return data


def load_tls(tls_dir: str | None = None, ca: str | None = None, cert: str | None = None,
             key: str | None = None) -> TlsConfig | None:
    """The TLS files from ``--tls-dir`` (ca.pem, member.pem, member.key) or the three
    ``--tls-ca/--tls-cert/--tls-key`` files (these override the folder's); None if none given."""
    if not (tls_dir or ca or cert or key):
        return None
    base = Path(tls_dir) if tls_dir else None
    if base is not None and not base.is_dir():
        raise ShoalError(f"--tls-dir {base} is not a folder (make one with `shoal keys --out {base}`)")
    paths = {}
    for name, given, default in (("ca", ca, CA_FILE), ("cert", cert, CERT_FILE), ("key", key, KEY_FILE)):
        if given:
            paths[name] = Path(given)
        elif base is not None:
            paths[name] = base / default
        else:
            raise ShoalError(f"--tls-{name} is missing: give --tls-ca, --tls-cert and --tls-key together, "
                             "or --tls-dir DIR")
    return TlsConfig(ca=_read(paths["ca"], "CA certificate", "--tls-ca"),
                     cert=_read(paths["cert"], "certificate", "--tls-cert"),
                     key=_read(paths["key"], "private key", "--tls-key"))


def is_loopback(host: str) -> bool:
    """True for ``localhost`` and loopback IP literals (127.0.0.0/8, ::1)."""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_plaintext(address: str, what: str) -> None:
    """Refuse plain text towards or on ``address`` unless its host is loopback."""
    host = address.rpartition(":")[0] if ":" in address else address
    if not is_loopback(host):
        raise ShoalError(f"{what} {address} is not loopback: plain text is refused there; "
                         "pass --tls-dir DIR (made by `shoal keys`) instead of --insecure")


def _write_private(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        os.fchmod(f.fileno(), 0o600)
        f.write(data)


def make_keys(out: str | Path, hosts: tuple[str, ...] = ()) -> Path:
    """Write a fresh run CA and a member certificate for ``hosts`` (plus loopback) into ``out``.

    Files: ``ca.pem`` (give to every member), ``member.pem`` and ``member.key`` (every member
    of the run), ``ca.key`` (mode 0600; only needed to sign more certificates). Refuses to
    overwrite existing keys.
    """
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    for h in hosts:  # checked before anything is written
        if h.strip("[] ") and not _HOST_NAME.fullmatch(h.strip("[] ")):
            try:
                ipaddress.ip_address(h.strip("[] "))
            except ValueError:
                raise ShoalError(f"--hosts: {h!r} is neither an IP address nor a host name "
                                 "(letters, digits, '-' and '.')") from None
    out = Path(out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ShoalError(f"cannot create {out} ({exc.strerror or exc}); give a writable --out") from None
    for name in (CA_FILE, CA_KEY_FILE, CERT_FILE, KEY_FILE):
        if (out / name).exists():
            raise ShoalError(f"{out / name} already exists; keys are never overwritten (use a new --out)")
    names: list[x509.GeneralName] = []
    for h in dict.fromkeys((*DEFAULT_HOSTS, *hosts)):
        h = h.strip().strip("[]")
        if not h:
            continue
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            if not _HOST_NAME.fullmatch(h):
                raise ShoalError(f"--hosts: {h!r} is neither an IP address nor a host name "
                                 "(letters, digits, '-' and '.')") from None
            names.append(x509.DNSName(h))
    now = datetime.datetime.now(datetime.UTC)
    start, end = now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=VALID_DAYS)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "shoal run CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(start).not_valid_after(end)
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False,
                                       key_encipherment=False, data_encipherment=False, key_agreement=False,
                                       key_cert_sign=True, crl_sign=True, encipher_only=False,
                                       decipher_only=False), critical=True)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "shoal member")]))
            .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(start).not_valid_after(end)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.SubjectAlternativeName(names), critical=False)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                  ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
            .sign(ca_key, hashes.SHA256()))
    pem = serialization.Encoding.PEM
    plain = serialization.NoEncryption()
    pkcs8 = serialization.PrivateFormat.PKCS8
    _write_private(out / CA_KEY_FILE, ca_key.private_bytes(pem, pkcs8, plain))
    _write_private(out / KEY_FILE, key.private_bytes(pem, pkcs8, plain))
    (out / CA_FILE).write_bytes(ca.public_bytes(pem))
    (out / CERT_FILE).write_bytes(cert.public_bytes(pem))
    return out
