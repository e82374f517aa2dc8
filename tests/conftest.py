"""Shared fixtures."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

_AWS_TEST_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_SESSION_TOKEN": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_CONFIG_FILE": "/dev/null",
    "AWS_SHARED_CREDENTIALS_FILE": "/dev/null",
}


@pytest.fixture(scope="session")
def s3_server() -> Iterator[str]:
    """A moto S3 server on 127.0.0.1 (random port) for the session; yields its endpoint URL.

    Dummy AWS credentials and region us-east-1 are set in the environment while it runs.
    Create a bucket per test (unique name) to keep tests independent.
    """
    from moto.server import ThreadedMotoServer

    with pytest.MonkeyPatch.context() as mp:
        for name, value in _AWS_TEST_ENV.items():
            mp.setenv(name, value)
        server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        server.start()
        try:
            host, port = server.get_host_and_port()
            yield f"http://{host}:{port}"
        finally:
            server.stop()
