"""The compose example with two experts (docker-compose.experts.yml): one prefill pool, the
consumer and a second consumer of the same producer (the base model itself, "demo-base"), each
behind the one gateway by its `model`, with the official openai client. Runs with the Docker
stage (deploy/scripts/ci-docker.sh); skips without an engine."""

from __future__ import annotations

import uuid

import openai
import pytest

from compose_cluster import UP_TIMEOUT_S, Cluster, free_port, openai_client, require_engine

pytestmark = [pytest.mark.docker, pytest.mark.slow, pytest.mark.timeout(UP_TIMEOUT_S + 300)]


def test_two_experts_behind_one_gateway_each_by_its_model():
    require_engine()
    c = Cluster(project=f"scd-e2e-experts-{uuid.uuid4().hex[:8]}", port=free_port(),
                overrides=("docker-compose.experts.yml",))
    try:
        c.up()
        c.read_api_key()
        oc = openai_client(c)
        assert sorted(m.id for m in oc.models.list().data) == ["consumer", "demo-base"]
        for model in ("consumer", "demo-base"):
            r = oc.completions.with_raw_response.create(model=model, prompt="The capital of France is",
                                                        max_tokens=6, temperature=0, extra_body={"scd_method": "raw"})
            assert r.parse().model == model and r.headers["x-scd-method"] == "raw"
        with pytest.raises(openai.NotFoundError, match="demo-base"):
            oc.completions.create(model="poet", prompt="hi", max_tokens=2)
    except BaseException:
        print(f"experts cluster logs in {c.save_logs()}")
        raise
    finally:
        c.down()
