"""Join credentials (``trainer.credential``): the daemon issues, a node proves, rank 0 checks."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trainer.contract import JOIN_CREDENTIAL_ENV
from trainer.credential import Authority, CredentialError, CredentialRefused, NodeCredential, Verifier

NOW = 1_700_000_000.0


def _ticket(number: int = 7, node: str = "n3", run: str = "job-ab12") -> dict:
    return {"run": run, "number": number, "node": node, "local_rank": 0, "local_world": 1, "expires": NOW + 300.5}


@pytest.fixture(scope="module")
def authority() -> Authority:
    return Authority.generate()


@pytest.fixture(scope="module")
def cred(authority: Authority) -> NodeCredential:
    return NodeCredential(authority.issue(run="job-ab12", node="n3", now=NOW, ttl_s=3600))


def _verifier(authority: Authority, run: str = "job-ab12") -> Verifier:
    return Verifier(authority.public_key, run)


def test_a_ticket_proved_by_its_node_is_admitted(authority, cred) -> None:
    fields = _ticket()
    assert _verifier(authority).check("ticket", fields, cred.prove("ticket", fields), now=NOW) == "n3"
    # a survivor of a loss queues alone as "<node>/rank<R>" with its node's credential
    lone = _ticket(node="n3/rank4")
    assert _verifier(authority).check("ticket", lone, cred.prove("ticket", lone), now=NOW) == "n3"
    assert cred.verifier().run == "job-ab12"  # rank 0's verifier comes from its own credential


def test_an_expired_credential_is_refused(authority, cred) -> None:
    fields = _ticket()
    with pytest.raises(CredentialRefused, match="expired"):
        _verifier(authority).check("ticket", fields, cred.prove("ticket", fields), now=NOW + 3600)


def test_a_credential_of_another_run_is_refused(authority) -> None:
    other = NodeCredential(authority.issue(run="job-old1", node="n3", now=NOW))
    fields = _ticket(run="job-old1")
    with pytest.raises(CredentialRefused, match="run 'job-old1', not 'job-ab12'"):
        _verifier(authority).check("ticket", fields, other.prove("ticket", fields), now=NOW)
    fields = _ticket()  # the right run in the ticket, the old one in its certificate
    with pytest.raises(CredentialRefused, match="run"):
        _verifier(authority).check("ticket", fields, other.prove("ticket", fields), now=NOW)


def test_a_credential_from_another_key_is_refused(authority) -> None:
    forged = NodeCredential(Authority.generate().issue(run="job-ab12", node="n3", now=NOW))
    fields = _ticket()
    with pytest.raises(CredentialRefused, match="not signed by this job's daemon"):
        _verifier(authority).check("ticket", fields, forged.prove("ticket", fields), now=NOW)


@pytest.mark.parametrize("change", [{"number": 8}, {"local_rank": 1}, {"local_world": 2}, {"expires": NOW + 301},
                                    {"node": "n4"}, {"node": "n3/rank"}, {"node": "n3x"}])
def test_a_tampered_or_replayed_ticket_is_refused(authority, cred, change: dict) -> None:
    """``number`` 8: the ticket copied off the store and queued again (a new number)."""
    proof = cred.prove("ticket", _ticket())
    with pytest.raises(CredentialRefused):
        _verifier(authority).check("ticket", {**_ticket(), **change}, proof, now=NOW)


def test_a_tampered_certificate_is_refused(authority, cred) -> None:
    fields = _ticket()
    proof = cred.prove("ticket", fields)
    cert = json.loads(proof["cert"])
    for change in ({"node": "n9"}, {"expires": NOW + 10**9}, {"run": "job-zz"}):
        bad = {**proof, "cert": json.dumps({**cert, **change}, sort_keys=True, separators=(",", ":"))}
        with pytest.raises(CredentialRefused, match="not signed by this job's daemon"):
            _verifier(authority).check("ticket", fields, bad, now=NOW)


def test_a_signature_for_one_purpose_does_not_serve_another(authority, cred) -> None:
    fields = _ticket()
    with pytest.raises(CredentialRefused, match="signature"):
        _verifier(authority).check("loss", fields, cred.prove("ticket", fields), now=NOW)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from(["cert", "cert_sig", "sig", "x"]),
                       st.one_of(st.none(), st.integers(), st.text(max_size=60), st.binary(max_size=40).map(
                           lambda b: __import__("base64").b64encode(b).decode()))))
def test_whatever_an_outsider_writes_is_refused_in_one_line(proof: dict) -> None:
    verifier = Verifier(Authority(b"\1" * 32).public_key, "job-ab12")
    with pytest.raises(CredentialRefused) as info:
        verifier.check("ticket", _ticket(), proof, now=NOW)
    assert "\n" not in str(info.value)


def test_the_credential_is_read_once_and_leaves_the_environment(authority) -> None:
    env = {JOIN_CREDENTIAL_ENV: authority.issue(run="job-ab12", node="n3", now=NOW), "OTHER": "1"}
    cred = NodeCredential.from_env(env)
    assert cred is not None and (cred.run, cred.node) == ("job-ab12", "n3")
    assert env == {"OTHER": "1"}  # code that prints the environment later does not print it
    assert "key" not in repr(cred) and NodeCredential.from_env(env) is None


@pytest.mark.parametrize("text", ["nope", "{}", json.dumps({"v": 1, "key": "AAAA", "authority": "AAAA"})])
def test_a_malformed_credential_names_the_variable(text: str) -> None:
    with pytest.raises(CredentialError, match=f"^\\${JOIN_CREDENTIAL_ENV}: "):
        NodeCredential.from_env({JOIN_CREDENTIAL_ENV: text})


def test_a_credential_whose_certificate_another_key_signed_is_malformed(authority) -> None:
    body = json.loads(authority.issue(run="r", node="n", now=NOW))
    body["authority"] = Authority.generate().public_key  # a trust anchor that did not sign it
    with pytest.raises(CredentialError, match="not signed"):
        NodeCredential(json.dumps(body))


def test_the_authority_round_trips_its_seed(authority) -> None:
    assert Authority(authority.seed).public_key == authority.public_key
    with pytest.raises(CredentialError, match="32"):
        Authority(b"short")
