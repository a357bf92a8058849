"""Fixtures for the container tests: a reachable engine and an up-to-date image.

Without a Docker engine the tests are skipped with the reason, except in CI
(``CI`` set to a true value), where a missing engine is a failure: the docker tests must
never pass silently where they are supposed to run.
"""

from __future__ import annotations

import os

import pytest

from tests.docker.cluster import DockerUnavailable, build_images, check_engine, compose_command


def _in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


@pytest.fixture(scope="session")
def docker_engine() -> None:
    """Skip (fail in CI) when no Docker engine or compose implementation is available."""
    try:
        check_engine()
        compose_command()
    except DockerUnavailable as exc:
        if _in_ci():
            pytest.fail(f"CI=true but the docker tests cannot run: {exc}", pytrace=False)
        pytest.skip(f"docker tests need a Docker engine: {exc}")


@pytest.fixture(scope="session")
def netdist_image(docker_engine: None) -> str:
    """Build (or confirm, in seconds when cached) ``netdist:local`` with
    docker/build-offline.sh, so the tests never run a stale image.
    ``NETDIST_DOCKER_SKIP_BUILD=1`` uses whatever image is there."""
    from tests.docker.cluster import IMAGE, docker

    if os.environ.get("NETDIST_DOCKER_SKIP_BUILD", "") not in ("", "0"):
        if docker("image", "inspect", IMAGE, check=False).returncode != 0:
            pytest.fail(f"NETDIST_DOCKER_SKIP_BUILD is set but {IMAGE} does not exist",
                        pytrace=False)
        return IMAGE
    build_images()
    return IMAGE
