"""Every metadata dialect against its local fake: the contract of tests/metadata_contract.py,
run once per dialect (aws, aliyun, gcp, azure), the token contract once per IMDS-style
dialect (aws, aliyun), and the types every dialect shares (daemon/gpunode/metadata/base.py).

What one cloud does its own way: tests/test_metadata_<cloud>.py.
"""

from __future__ import annotations

from datetime import datetime

import pytest

from daemon.gpunode.metadata import MetadataError, MetadataUnavailable, Notice, NoticeKind, notice_id
from daemon.gpunode.metadata.registry import DIALECTS as NAMES
from daemon.providers.local_metadata import FAKES, make_fake
from metadata_contract import TOKEN_DIALECTS, Dialect, MetadataContract, TokenContract, TokenDialect, dialects
import metadata_contract


# the contract's fixtures, under their own names (pytest finds fixtures by module attribute)
client, fake, fake_clock, http = (metadata_contract.client, metadata_contract.fake,
                                  metadata_contract.fake_clock, metadata_contract.http)


class TestMetadataContract(MetadataContract):
    @pytest.fixture(params=dialects())
    def dialect(self, request: pytest.FixtureRequest) -> Dialect:
        return request.param


class TestTokenContract(TokenContract):
    @pytest.fixture(params=[pytest.param(t, id=str(t)) for t in TOKEN_DIALECTS])
    def token_dialect(self, request: pytest.FixtureRequest) -> TokenDialect:
        return request.param

    @pytest.fixture
    def dialect(self, token_dialect: TokenDialect) -> Dialect:
        return token_dialect.dialect


# -- what every dialect shares --------------------------------------------------------------


def test_every_dialect_has_a_fake_and_a_contract_entry() -> None:
    assert tuple(FAKES) == NAMES
    assert tuple(d.name for d in (p.values[0] for p in dialects())) == NAMES
    with pytest.raises(ValueError, match="unknown metadata dialect"):
        make_fake("ibm")


def test_unavailable_is_a_metadata_error() -> None:
    assert issubclass(MetadataUnavailable, MetadataError)


def test_notice_rejects_naive_deadline() -> None:
    with pytest.raises(ValueError, match="aware"):
        Notice.build(provider="aws", kind=NoticeKind.INTERRUPTION, action="terminate",
                     deadline=datetime(2017, 9, 18, 8, 22), raw="{}")


def test_notice_id_depends_on_provider_kind_raw() -> None:
    ids = {
        notice_id("aws", NoticeKind.INTERRUPTION, "x"),
        notice_id("aliyun", NoticeKind.INTERRUPTION, "x"),
        notice_id("aws", NoticeKind.REBALANCE, "x"),
        notice_id("aws", NoticeKind.INTERRUPTION, "y"),
    }
    assert len(ids) == 4
    assert notice_id("aws", NoticeKind.INTERRUPTION, "x") == notice_id("aws", "interruption", "x")
