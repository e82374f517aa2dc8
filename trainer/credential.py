"""Join credentials: who may enter a running group through the rendezvous store.

The rendezvous store (a c10d ``TCPStore``) has no authentication: whoever reaches its
port can queue a join ticket (:class:`trainer.membership.JoinQueue`). So rank 0 admits a
ticket only when it carries a credential the job's daemon issued to the node that queued
it, and a proof that the ticket was made by that node, not copied off the store.

- **The authority** (:class:`Authority`) is the daemon's per-job Ed25519 key (32 random
  bytes from :mod:`secrets`), kept in the daemon's state. When the daemon admits a node it
  issues that node a credential (:meth:`Authority.issue`) and sends it over the agent's
  TLS channel in the reply that tells the agent to start the trainer; the agent hands it
  to the workers in ``$SPOTVISOR_JOIN_CREDENTIAL`` (:data:`trainer.contract.JOIN_CREDENTIAL_ENV`),
  never on a command line.
- **A credential** (:class:`NodeCredential`) holds a certificate, ``{"run", "node",
  "expires", "key"}`` signed by the authority (``key``: a fresh Ed25519 public key made
  for this node), the matching private key, and the authority's public key: the trust
  anchor rank 0 checks every ticket against. An admitted node can prove it is itself;
  it cannot mint a credential for another node (it never holds the authority's key).
- **A proof** (:meth:`NodeCredential.prove`) is the certificate plus the node key's
  signature over the exact fields of one ticket, its store number included. A ticket
  copied off the store and queued again gets a new number, which its signature does
  not cover: it is refused (:meth:`Verifier.check`).

Signatures are Ed25519 (RFC 8032) through the ``cryptography`` library
(https://cryptography.io/en/latest/hazmat/primitives/asymmetric/ed25519/); each signed
message starts with its own context string, so a signature for one purpose never
verifies for another. Signed JSON is canonical: sorted keys, no spaces, ASCII.

What it does not do: the store stays unauthenticated, so whoever reaches it can still
delete or overwrite keys (deny a grow) or race an admitted joiner into the new group
with the rank the admission names. See README, "Trust model".
"""

from __future__ import annotations

import base64
import binascii
import json
import os
import re
import secrets
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from trainer.contract import JOIN_CREDENTIAL_ENV

__all__ = ["Authority", "NodeCredential", "Verifier", "CredentialError", "CredentialRefused", "CREDENTIAL_TTL_S",
           "canonical"]

#: How long a credential is good for (seconds): the node's whole stay in a long job (a
#: survivor late to a loss round queues with it hours after it was admitted).
CREDENTIAL_TTL_S = 30 * 86400.0
_CONTEXT = b"spotvisor join credential v1\0"
_MAX_FIELD = 4096  # characters: a certificate or signature longer than this is not ours
_NODE_RANK = re.compile(r"/rank[0-9]{1,6}")


class CredentialError(ValueError):
    """A credential that cannot be used (malformed, or not this job's). ``str()`` is one line."""


class CredentialRefused(CredentialError):
    """A ticket whose proof does not hold. ``str()`` is one line: why."""


def canonical(fields: Mapping[str, Any]) -> bytes:
    """The bytes a signature covers: JSON, sorted keys, no spaces, ASCII, no NaN."""
    return json.dumps(fields, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode()


def _b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


def _unb64(text: Any, what: str) -> bytes:
    if not isinstance(text, str) or len(text) > _MAX_FIELD:
        raise CredentialError(f"{what}: not a base64 string")
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise CredentialError(f"{what}: not base64") from None


def _message(purpose: str, payload: bytes) -> bytes:
    return _CONTEXT + purpose.encode() + b"\0" + payload


class Authority:
    """The daemon's signing key for one job's credentials (Ed25519). Holds the private key."""

    __slots__ = ("_key",)

    def __init__(self, seed: bytes) -> None:
        """``seed``: the 32-byte private key (:meth:`generate`, or what :attr:`seed` gave).

        Raises:
            CredentialError: ``seed`` is not 32 bytes.
        """
        if len(seed) != 32:
            raise CredentialError(f"the join key is {len(seed)} bytes, not 32")
        self._key = Ed25519PrivateKey.from_private_bytes(seed)

    @classmethod
    def generate(cls) -> "Authority":
        """A new key: 32 bytes from :func:`secrets.token_bytes`."""
        return cls(secrets.token_bytes(32))

    @property
    def seed(self) -> bytes:
        """The private key's 32 bytes (to keep it: the daemon's store, 0600)."""
        return self._key.private_bytes_raw()

    @property
    def public_key(self) -> str:
        """The public key, base64: what rank 0 checks certificates with."""
        return _b64(self._key.public_key().public_bytes_raw())

    def issue(self, *, run: str, node: str, now: float, ttl_s: float = CREDENTIAL_TTL_S) -> str:
        """A credential for ``node`` in run ``run``, good until ``now + ttl_s`` (unix
        seconds): the value of ``$SPOTVISOR_JOIN_CREDENTIAL`` (JSON text, holding a
        private key: send it over TLS only, never log it or put it on a command line)."""
        node_key = Ed25519PrivateKey.generate()
        cert = canonical({"v": 1, "run": run, "node": node, "expires": round(now + ttl_s, 3),
                          "key": _b64(node_key.public_key().public_bytes_raw())}).decode()
        return json.dumps({"v": 1, "cert": cert, "cert_sig": _b64(self._key.sign(_message("cert", cert.encode()))),
                           "key": _b64(node_key.private_bytes_raw()), "authority": self.public_key})


@dataclass(frozen=True, slots=True)
class _Cert:
    run: str
    node: str
    expires: float
    key: Ed25519PublicKey


def _cert(text: Any, signature: Any, authority: Ed25519PublicKey) -> _Cert:
    """The certificate ``text`` once ``signature`` by ``authority`` verifies."""
    if not isinstance(text, str) or len(text) > _MAX_FIELD:
        raise CredentialRefused("no certificate")
    try:
        authority.verify(_unb64(signature, "certificate signature"), _message("cert", text.encode()))
    except InvalidSignature:
        raise CredentialRefused("its certificate is not signed by this job's daemon") from None
    except CredentialError as exc:
        raise CredentialRefused(str(exc)) from None
    body = json.loads(text)  # signed by the daemon: well-formed
    return _Cert(str(body["run"]), str(body["node"]), float(body["expires"]),
                 Ed25519PublicKey.from_public_bytes(base64.b64decode(body["key"])))


class NodeCredential:
    """This node's credential, from ``$SPOTVISOR_JOIN_CREDENTIAL`` (:meth:`from_env`)."""

    __slots__ = ("run", "node", "expires", "_cert", "_cert_sig", "_key", "_authority")

    def __init__(self, text: str) -> None:
        """Parse what :meth:`Authority.issue` made.

        Raises:
            CredentialError: malformed, or its certificate is not signed by the authority it names.
        """
        try:
            body = json.loads(text)
        except ValueError:
            raise CredentialError("not JSON") from None
        if not isinstance(body, dict) or body.get("v") != 1:
            raise CredentialError("not a version 1 credential")
        seed = _unb64(body.get("key"), "key")
        authority = _unb64(body.get("authority"), "authority")
        if len(seed) != 32 or len(authority) != 32:
            raise CredentialError("key and authority must be 32 bytes each")
        self._authority = Ed25519PublicKey.from_public_bytes(authority)
        self._key = Ed25519PrivateKey.from_private_bytes(seed)
        try:
            cert = _cert(body.get("cert"), body.get("cert_sig"), self._authority)
        except CredentialRefused as exc:
            raise CredentialError(str(exc)) from None
        if cert.key.public_bytes_raw() != self._key.public_key().public_bytes_raw():
            raise CredentialError("its key is not the one its certificate names")
        self.run, self.node, self.expires = cert.run, cert.node, cert.expires
        self._cert, self._cert_sig = str(body["cert"]), str(body["cert_sig"])

    def __repr__(self) -> str:  # never the key
        return f"NodeCredential(run={self.run!r}, node={self.node!r}, expires={self.expires})"

    @classmethod
    def from_env(cls, environ: MutableMapping[str, str] | None = None) -> "NodeCredential | None":
        """This node's credential, taken out of ``environ`` (default ``os.environ``), so code
        that later prints the environment does not print it; None when there is none.

        Raises:
            CredentialError: it is there but malformed (the message names the variable).
        """
        env = os.environ if environ is None else environ
        text = env.pop(JOIN_CREDENTIAL_ENV, None)
        if not text:
            return None
        try:
            return cls(text)
        except CredentialError as exc:
            raise CredentialError(f"${JOIN_CREDENTIAL_ENV}: {exc}") from None

    def prove(self, purpose: str, fields: Mapping[str, Any]) -> dict[str, str]:
        """``{"cert", "cert_sig", "sig"}``: this node's certificate and its signature over
        ``fields`` (canonical JSON) for ``purpose``; :meth:`Verifier.check` takes them back."""
        return {"cert": self._cert, "cert_sig": self._cert_sig,
                "sig": _b64(self._key.sign(_message(purpose, canonical(fields))))}

    def verifier(self) -> "Verifier":
        """A verifier for this node's run with the authority this credential came from."""
        return Verifier(self._authority, self.run)


class Verifier:
    """Checks proofs (:meth:`NodeCredential.prove`) against the job's authority, for one run."""

    __slots__ = ("_authority", "run")

    def __init__(self, authority: Ed25519PublicKey | str, run: str) -> None:
        if isinstance(authority, str):
            authority = Ed25519PublicKey.from_public_bytes(_unb64(authority, "authority"))
        self._authority, self.run = authority, run

    def check(self, purpose: str, fields: Mapping[str, Any], proof: Mapping[str, Any], *, now: float) -> str:
        """The node that made ``fields`` (a ticket: its ``node``, ``run`` and the rest) for
        ``purpose``, once its proof holds: the certificate is the authority's, for this
        run, not expired at ``now`` (unix seconds), issued to ``fields["node"]`` (or that
        node with a ``/rank<N>`` suffix: a survivor of a loss that queues alone), and the
        node key it names signed exactly ``fields``.

        Raises:
            CredentialRefused: which of those fails, in one line.
        """
        cert = _cert(proof.get("cert"), proof.get("cert_sig"), self._authority)
        if cert.run != self.run or fields.get("run") != self.run:
            raise CredentialRefused(f"its credential is for run {cert.run!r}, not {self.run!r}")
        if now >= cert.expires:
            raise CredentialRefused(f"its credential expired at {cert.expires:.0f}")
        node = fields.get("node")
        if not isinstance(node, str) or not (node == cert.node or (
                node.startswith(cert.node) and _NODE_RANK.fullmatch(node[len(cert.node):]))):
            raise CredentialRefused(f"its credential is node {cert.node!r}'s")
        try:
            cert.key.verify(_unb64(proof.get("sig"), "signature"), _message(purpose, canonical(fields)))
        except (InvalidSignature, CredentialError, ValueError):
            raise CredentialRefused("its signature does not cover this ticket (copied from another?)") from None
        return cert.node
