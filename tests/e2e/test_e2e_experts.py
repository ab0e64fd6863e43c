"""Two experts behind one gateway, as `scd-serve up --expert` runs them: a base model and its
LoRA fine-tune (the adapter directory, as users have it) fed by one prefill worker. The openai
client reaches each by its `model`; a prompt both read is prefilled once; an unknown model is
a 404 that names those served."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time

import openai
import psutil
import pytest
import torch

from scd_serve.model.tiny import save_tiny_model

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def lora_adapter(base, out):
    import transformers
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(transformers.AutoModelForCausalLM.from_pretrained(str(base)),
                           LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn_like(p) * 0.2)
    model.save_pretrained(str(out))
    return out


@pytest.fixture(scope="module")
def experts(tmp_path_factory):
    root = tmp_path_factory.mktemp("experts")
    base = save_tiny_model(root / "base", "llama", seed=0)
    adapter = lora_adapter(base, root / "coder-adapter")
    env = os.environ | {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "SCD_CACHE_DIR": str(root / "cache")}
    proc = subprocess.Popen([sys.executable, "-m", "scd_serve.cli", "up", "--port", "0", "--producer", str(base),
                             "--consumer", str(base), "--codebook", "", "--method", "raw",
                             "--expert", f"coder={adapter}", "--ready-timeout-s", "400"],
                            stdout=subprocess.PIPE, text=True, env=env)
    lines: list[str] = []
    threading.Thread(target=lambda: [lines.append(ln) for ln in proc.stdout], daemon=True).start()
    end, url = time.monotonic() + 420, None
    while time.monotonic() < end and url is None and proc.poll() is None:
        url = next((m.group(1) for ln in list(lines) if (m := re.search(r"is up: (http://\S+)/v1", ln))), None)
        time.sleep(0.5)
    if url is None:
        proc.kill()
        pytest.fail(f"scd-serve up did not come up: {lines[-20:]}")
    yield url
    workers = psutil.Process(proc.pid).children(recursive=True)
    proc.send_signal(2)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
    for w in workers:
        if w.is_running():
            w.kill()


def test_each_expert_by_its_model_one_prefill_for_a_prompt_both_read(experts):
    client = openai.OpenAI(base_url=f"{experts}/v1", api_key="unused", timeout=60, max_retries=0)
    assert sorted(m.id for m in client.models.list().data) == ["base", "coder"]
    prompt = "a prompt that the base model and its coder both read"
    answers = {}
    for model in ("base", "coder"):
        r = client.completions.with_raw_response.create(model=model, prompt=prompt, max_tokens=6, temperature=0)
        body = r.parse()
        assert body.model == model and r.headers["x-scd-method"] == "raw"
        answers[model] = (body.choices[0].text, body.model_extra["scd"]["transfer"]["cache_hit"])
    assert answers["base"][1] is False and answers["coder"][1] is True  # the coder's codes: no second prefill
    local = {m: client.completions.create(model=m, prompt=prompt, max_tokens=6, temperature=0,
                                          extra_body={"scd_method": "local"}).choices[0].text for m in answers}
    assert answers["base"][0] == local["base"]  # raw is lossless where the producer is the consumer
    assert local["coder"] != local["base"]  # the adapter is served: another model answers
    with pytest.raises(openai.NotFoundError, match="'base', 'coder'"):
        client.completions.create(model="poet", prompt=prompt, max_tokens=2)
