"""TLS for the agent port: the daemon's own small CA, or the operator's files.

Every agent request carries its node's bearer token, so the agent port speaks TLS
whenever it listens beyond loopback (``daemon.agent_tls``, :class:`daemon.config.DaemonSpec`).
The nodes trust exactly one CA, whose certificate the daemon hands to each node it
launches (:attr:`daemon.providers.base.NodeSpec.ca_cert_pem`; the agent's ``--ca-file``).

**The daemon's own CA** (no ``tls_*_file`` in the config): at the first start it makes,
under ``<state_dir>/tls/`` (0700),

===============  =====  ===========================================================
``ca.key``       0600   the CA's private key (ECDSA P-256)
``ca.pem``       0644   the CA certificate, self-signed, 10 years: what the nodes trust
``agent.key``    0600   the agent port's private key (ECDSA P-256)
``agent.pem``    0644   the agent port's certificate, signed by the CA, 2 years
===============  =====  ===========================================================

Later starts reuse them. The server certificate is issued again (by the same CA, so
the nodes already running keep trusting the daemon) when it is missing, unreadable,
not the CA's, expires within :data:`RENEW_BEFORE`, or its names no longer cover
``agent_host``. A new CA is made only when its key or certificate is missing or
unusable, or it expires within :data:`RENEW_BEFORE` (the nodes launched before then
no longer trust the daemon: they are replaced as lost nodes). Each file is written
to a temporary file in the same directory, fsynced, then renamed over the old one
(rename is atomic on POSIX), so a crash never leaves a half-written key; a
temporary file a crash left behind is removed at the next start.

**The operator's files** (``tls_cert_file``, ``tls_key_file``, ``tls_ca_file``): used as
they are; the certificate must name ``agent_host``, since the nodes are given
``https://<agent_host>:<port>`` and check the name.

Certificate profile (RFC 5280, https://www.rfc-editor.org/rfc/rfc5280):

- CA: ``basicConstraints`` cA=TRUE, pathLenConstraint 0, critical (§4.2.1.9);
  ``keyUsage`` keyCertSign + cRLSign (+ digitalSignature), critical (§4.2.1.3);
  ``subjectKeyIdentifier`` (§4.2.1.2).
- Server: ``subjectAltName`` with an iPAddress entry for an IP and a dNSName entry for
  a name (§4.2.1.6): ``agent_host``, and 127.0.0.1, ::1, localhost; ``basicConstraints``
  cA=FALSE, critical; ``keyUsage`` digitalSignature, critical; ``extKeyUsage``
  id-kp-serverAuth (§4.2.1.12); ``authorityKeyIdentifier`` = the CA's key id (§4.2.1.1).
- Serial numbers: random, positive, at most 20 octets (§4.1.2.2).
- Validity starts a day back, so a node whose clock is a little behind accepts it.

A TLS client checks the server's identity against ``subjectAltName`` only, never
the subject's CN (RFC 6125 §6.4.4, RFC 9525 §6.3; Python's ``ssl`` with
``check_hostname``). The builder calls follow the cryptography library's X.509
tutorial (https://cryptography.io/en/latest/x509/tutorial/, "Creating a
self-signed certificate" and "Creating a CA hierarchy") and its reference
(https://cryptography.io/en/latest/x509/reference/).

All of it is blocking file and crypto work: async code calls :func:`agent_tls`, which
runs it through :func:`asyncio.to_thread`.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import hashlib
import ipaddress
import os
import ssl
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import structlog
from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from daemon.state_dir import UnsafeStatePath, open_private, private_dir

if TYPE_CHECKING:
    from daemon.config import DaemonSpec

__all__ = ["TlsError", "AgentTls", "agent_tls", "load_agent_tls", "ensure_own_ca", "server_context",
           "required_names", "names_of", "covers", "fingerprint", "CA_VALID", "SERVER_VALID", "RENEW_BEFORE"]

log = structlog.get_logger("spotvisor.tls")

CA_VALID = dt.timedelta(days=3650)
SERVER_VALID = dt.timedelta(days=730)
# a certificate that expires within this is replaced at the daemon's start
RENEW_BEFORE = dt.timedelta(days=30)
_BACKDATE = dt.timedelta(days=1)
_LOCAL_NAMES = ("127.0.0.1", "::1", "localhost")  # the control node's own agents and checks


class TlsError(OSError):
    """The agent port's certificate cannot be made or used. An :class:`OSError`, so
    ``spotvisord run`` reports it in one line as any other listener problem."""


@dataclass(frozen=True)
class AgentTls:
    """The agent port's TLS: the server context, and the CA certificate (PEM) the nodes trust."""

    context: ssl.SSLContext
    ca_pem: bytes

    @property
    def ca_fingerprint(self) -> str:
        return fingerprint(self.ca_pem)


async def agent_tls(daemon: "DaemonSpec", state_dir: Path) -> AgentTls | None:
    """The agent port's TLS for this config, or None when it is plain HTTP
    (``daemon.agent_tls``). Blocking work runs in a thread."""
    if not daemon.agent_tls_on():
        return None
    ctx, ca_pem = await asyncio.to_thread(load_agent_tls, daemon, state_dir)
    return AgentTls(ctx, ca_pem)


def load_agent_tls(daemon: "DaemonSpec", state_dir: Path, *,
                   now: dt.datetime | None = None) -> tuple[ssl.SSLContext, bytes]:
    """(server SSL context, CA certificate PEM): the operator's files when the config
    names them, else the daemon's own CA under ``state_dir/tls`` (made or renewed as
    needed). Blocking.

    Raises:
        TlsError: a file is unreadable or not PEM, the key does not match the
            certificate, or the operator's certificate does not name ``agent_host``.
    """
    if daemon.tls_cert_file is not None:
        assert daemon.tls_key_file is not None and daemon.tls_ca_file is not None  # the config's validator
        cert, key, ca = (Path(os.path.expanduser(p)) for p in (daemon.tls_cert_file, daemon.tls_key_file,
                                                               daemon.tls_ca_file))
        try:
            ca_pem = ca.read_bytes()
            x509.load_pem_x509_certificates(ca_pem)
            leaf = x509.load_pem_x509_certificate(cert.read_bytes())
        except OSError as exc:
            raise TlsError(f"agent TLS: {exc.filename}: {exc.strerror}") from None
        except ValueError as exc:
            raise TlsError(f"agent TLS: daemon.tls_cert_file / tls_ca_file: not a PEM certificate ({exc})") from None
        if not covers(leaf, daemon.agent_host, local=False):
            raise TlsError(f"agent TLS: daemon.tls_cert_file {cert} does not name agent_host {daemon.agent_host} "
                           f"(its names: {', '.join(sorted(names_of(leaf))) or 'none'}); nodes would refuse it "
                           "(issue it with agent_host in its subjectAltName)")
        log.info("agent_tls_operator_files", cert=str(cert), ca_fingerprint=fingerprint(ca_pem))
        return server_context(cert, key), ca_pem
    cert, key, ca_pem = ensure_own_ca(state_dir / "tls", daemon.agent_host, now=now)
    return server_context(cert, key), ca_pem


def server_context(cert: Path, key: Path) -> ssl.SSLContext:
    """A TLS server context (TLS 1.2 or later) holding ``cert`` and its ``key``."""
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_cert_chain(cert, key)
    except ssl.SSLError as exc:
        raise TlsError(f"agent TLS: {cert} with {key}: {exc.reason or exc} (the key must be the certificate's, "
                       "both PEM)") from None
    except OSError as exc:
        raise TlsError(f"agent TLS: {exc.filename or cert}: {exc.strerror}") from None
    return ctx


# -- the daemon's own CA ---------------------------------------------------------------

def ensure_own_ca(tls_dir: Path, agent_host: str, *, now: dt.datetime | None = None) -> tuple[Path, Path, bytes]:
    """The daemon's CA and agent-port certificate under ``tls_dir``, made or renewed as
    needed (module docstring). Returns (server cert path, server key path, CA PEM). Blocking.

    Raises:
        UnsafeStatePath: ``tls_dir`` or a file in it is a symbolic link, a FIFO or
            another uid's (:mod:`daemon.state_dir`); nothing is followed or replaced.
    """
    now = now or dt.datetime.now(dt.timezone.utc)
    tls_dir.parent.mkdir(parents=True, exist_ok=True)  # the state directory (made before, by the daemon)
    private_dir(tls_dir, root=tls_dir.parent)  # a link planted there is refused, not followed
    os.chmod(tls_dir, 0o700)
    for stale in tls_dir.glob(".*.tmp"):  # a write a crash cut short
        with contextlib.suppress(FileNotFoundError):
            stale.unlink()
    ca_key_path, ca_path = tls_dir / "ca.key", tls_dir / "ca.pem"
    key_path, cert_path = tls_dir / "agent.key", tls_dir / "agent.pem"

    ca = _load_pair(ca_path, ca_key_path)
    why_ca = _ca_problem(ca, now)
    if why_ca is not None:
        ca_key = ec.generate_private_key(ec.SECP256R1())
        ca_cert = _issue_ca(ca_key, now)
        _write_atomic(ca_key_path, _key_pem(ca_key), 0o600)  # the key first: a cert without its key is useless
        _write_atomic(ca_path, ca_cert.public_bytes(serialization.Encoding.PEM), 0o644)
        log.info("agent_ca_created", reason=why_ca, path=str(ca_path),
                 not_after=ca_cert.not_valid_after_utc.isoformat(),
                 ca_fingerprint=fingerprint(ca_cert.public_bytes(serialization.Encoding.PEM)))
    else:
        assert ca is not None
        ca_cert, ca_key = ca

    server = _load_pair(cert_path, key_path)
    why = _server_problem(server, ca_cert, agent_host, now)
    if why is not None:
        key = ec.generate_private_key(ec.SECP256R1())
        cert = _issue_server(key, ca_cert, ca_key, agent_host, now)
        _write_atomic(key_path, _key_pem(key), 0o600)
        _write_atomic(cert_path, cert.public_bytes(serialization.Encoding.PEM), 0o644)
        log.info("agent_cert_issued", reason=why, path=str(cert_path), names=sorted(names_of(cert)),
                 not_after=cert.not_valid_after_utc.isoformat())
    return cert_path, key_path, ca_cert.public_bytes(serialization.Encoding.PEM)


def _ca_problem(ca: tuple[x509.Certificate, ec.EllipticCurvePrivateKey] | None, now: dt.datetime) -> str | None:
    if ca is None:
        return "no usable CA (first start, or its files are missing or damaged)"
    cert, _ = ca
    try:
        bc = cert.extensions.get_extension_for_class(x509.BasicConstraints).value
    except x509.ExtensionNotFound:
        return "not a CA certificate"
    if not bc.ca:
        return "not a CA certificate"
    if cert.not_valid_after_utc - now < RENEW_BEFORE:
        return f"expires {cert.not_valid_after_utc.isoformat()}"
    return None


def _server_problem(server: tuple[x509.Certificate, ec.EllipticCurvePrivateKey] | None, ca: x509.Certificate,
                    agent_host: str, now: dt.datetime) -> str | None:
    if server is None:
        return "no usable certificate (first start, or its files are missing or damaged)"
    cert, _ = server
    try:
        cert.verify_directly_issued_by(ca)
    except (InvalidSignature, ValueError, TypeError):  # another CA's
        return "not issued by the current CA"
    if cert.not_valid_after_utc - now < RENEW_BEFORE:
        return f"expires {cert.not_valid_after_utc.isoformat()}"
    if not covers(cert, agent_host):
        return f"its names {sorted(names_of(cert))} do not cover agent_host {agent_host}"
    return None


def _load_pair(cert_path: Path, key_path: Path) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey] | None:
    """The certificate and its key, or None when either is missing, unreadable, not
    PEM, or the key is not the certificate's. Raises :class:`UnsafeStatePath` for a
    symbolic link, FIFO or another uid's file there (not replaced as damaged)."""
    try:
        cert_pem, key_pem = _read_private(cert_path), _read_private(key_path)
    except UnsafeStatePath:
        raise
    except OSError:
        return None
    if cert_pem is None or key_pem is None:
        return None
    try:
        cert = x509.load_pem_x509_certificate(cert_pem)
        key = serialization.load_pem_private_key(key_pem, password=None)
    except (ValueError, TypeError):
        return None
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        return None
    spki = serialization.PublicFormat.SubjectPublicKeyInfo
    der = serialization.Encoding.DER
    if cert.public_key().public_bytes(der, spki) != key.public_key().public_bytes(der, spki):
        return None
    return cert, key


def _issue_ca(key: ec.EllipticCurvePrivateKey, now: dt.datetime) -> x509.Certificate:
    name = x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "spotvisor"),
                      x509.NameAttribute(NameOID.COMMON_NAME, "spotvisor agent CA")])
    ski = x509.SubjectKeyIdentifier.from_public_key(key.public_key())
    return (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - _BACKDATE)
        .not_valid_after(now + CA_VALID)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False, key_encipherment=False,
                                     data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                     crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
        .add_extension(ski, critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ski), critical=False)
        .sign(key, hashes.SHA256())
    )


def _issue_server(key: ec.EllipticCurvePrivateKey, ca: x509.Certificate, ca_key: ec.EllipticCurvePrivateKey,
                  agent_host: str, now: dt.datetime) -> x509.Certificate:
    host = _bare(agent_host)
    ca_ski = ca.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
    return (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "spotvisor"),
                                 x509.NameAttribute(NameOID.COMMON_NAME, (host or "spotvisord")[:64])]))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - _BACKDATE)
        .not_valid_after(min(now + SERVER_VALID, ca.not_valid_after_utc))
        .add_extension(x509.SubjectAlternativeName(required_names(agent_host)), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False, key_encipherment=False,
                                     data_encipherment=False, key_agreement=False, key_cert_sign=False,
                                     crl_sign=False, encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ca_ski), critical=False)
        .sign(ca_key, hashes.SHA256())
    )


# -- names -------------------------------------------------------------------------------

def _bare(host: str) -> str:
    text = host.strip()
    if text.startswith("[") and text.endswith("]"):
        text = text[1:-1]
    return text


def _general_name(host: str) -> x509.GeneralName:
    """An iPAddress entry for an IP literal, a dNSName entry for a name (RFC 5280 §4.2.1.6)."""
    text = _bare(host)
    try:
        return x509.IPAddress(ipaddress.ip_address(text))
    except ValueError:
        return x509.DNSName(text.lower().rstrip("."))


def required_names(agent_host: str, *, local: bool = True) -> list[x509.GeneralName]:
    """The subjectAltName entries the agent port's certificate must hold: ``agent_host``
    (and with ``local``, 127.0.0.1, ::1 and localhost), without repeats."""
    names: list[x509.GeneralName] = []
    for host in (agent_host, *(_LOCAL_NAMES if local else ())):
        gn = _general_name(host)
        if gn not in names:
            names.append(gn)
    return names


def names_of(cert: x509.Certificate) -> set[str]:
    """The certificate's subjectAltName entries, as text (IP addresses and DNS names)."""
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return set()
    return {str(a) for a in san.get_values_for_type(x509.IPAddress)} | set(san.get_values_for_type(x509.DNSName))


def covers(cert: x509.Certificate, agent_host: str, *, local: bool = True) -> bool:
    """Whether every name of :func:`required_names` is in the certificate's subjectAltName
    (a DNS name matched exactly, or by a ``*.`` wildcard for one leftmost label)."""
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return False
    ips = set(san.get_values_for_type(x509.IPAddress))
    dns = {d.lower().rstrip(".") for d in san.get_values_for_type(x509.DNSName)}
    for gn in required_names(agent_host, local=local):
        if isinstance(gn, x509.IPAddress):
            if gn.value not in ips:
                return False
        else:
            name = gn.value
            wild = "*." + name.split(".", 1)[1] if "." in name else None
            if name not in dns and (wild is None or wild not in dns):
                return False
    return True


def fingerprint(pem: bytes) -> str:
    """SHA-256 of the (first) certificate's DER encoding, hex: what ``openssl x509
    -fingerprint -sha256`` prints, without the colons."""
    return hashlib.sha256(x509.load_pem_x509_certificate(pem).public_bytes(serialization.Encoding.DER)).hexdigest()


# -- files -------------------------------------------------------------------------------

def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _read_private(path: Path) -> bytes | None:
    """``path``'s bytes, None when missing; never through a link (:func:`open_private`)."""
    try:
        fd = open_private(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    with os.fdopen(fd, "rb") as f:
        return f.read()


def _write_atomic(path: Path, data: bytes, mode: int) -> None:
    """Write ``data`` to ``path`` with ``mode``, all or nothing: a temporary file in the same
    directory (created 0600 by :func:`tempfile.mkstemp`), fsynced, renamed over ``path``,
    then the directory fsynced so the rename survives a power loss."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), mode)
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    dfd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
