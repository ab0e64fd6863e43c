"""The worker commands' allocator: chosen by SCD_ALLOCATOR, preloaded by re-executing the
process once (same pid, same command line), and said at start."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from scd_serve.control import allocator
from scd_serve.errors import ConfigError

# a shared library every install has, harmless to preload (vLLM's CPU build preloads it too)
LIBGOMP = next((Path(torch.__file__).parent / "lib").glob("libgomp*.so*"), None)
SHOW = ("import json, os, sys; from scd_serve.control.allocator import loaded, reexec_with_allocator; "
        "reexec_with_allocator(sys.argv[1], sys.argv[1:]); "
        "print(json.dumps({'pid': os.getpid(), 'argv': sys.argv[1:], 'preload': os.environ.get('LD_PRELOAD', ''), "
        "'mapped': open('/proc/self/maps').read().count(sys.argv[2]) > 0, 'loaded': loaded()}))")


def run_show(command: str, env: dict, *args: str) -> list[dict]:
    """-> one JSON line per process that got to print (the re-executed one prints once)"""
    lib = LIBGOMP.name if LIBGOMP else "none"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SCD_ALLOCATOR", "SCD_DEVICE", "LD_PRELOAD"))} | env
    proc = subprocess.Popen([sys.executable, "-c", SHOW, command, lib, *args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 0, stderr
    shown = [json.loads(line) for line in stdout.splitlines()]
    assert all(s["pid"] == proc.pid for s in shown)  # exec: the process a supervisor started, still
    return shown


def test_the_choice_system_none_or_a_library_and_a_missing_file_is_refused_by_name(tmp_path):
    assert allocator.wanted({"SCD_ALLOCATOR": "system"}) == ""
    assert allocator.wanted({}) == allocator.find_tcmalloc()  # auto: tcmalloc where the machine has it
    lib = tmp_path / "libmine.so"
    lib.write_bytes(b"")
    assert allocator.wanted({"SCD_ALLOCATOR": str(lib)}) == str(lib)
    with pytest.raises(ConfigError, match="SCD_ALLOCATOR='/no/such.so': not a file; use auto, system"):
        allocator.wanted({"SCD_ALLOCATOR": "/no/such.so"})


@pytest.mark.skipif(not sys.platform.startswith("linux") or LIBGOMP is None, reason="LD_PRELOAD: Linux")
def test_a_worker_command_runs_again_once_with_the_library_preloaded_same_pid_and_arguments():
    [shown] = run_show("decode", {"SCD_ALLOCATOR": str(LIBGOMP)}, "--device", "cpu")
    assert shown["preload"].split(":")[0] == str(LIBGOMP) and shown["mapped"]
    assert shown["argv"] == ["decode", LIBGOMP.name, "--device", "cpu"]


@pytest.mark.skipif(not sys.platform.startswith("linux") or LIBGOMP is None, reason="LD_PRELOAD: Linux")
@pytest.mark.parametrize("command, env, args", [
    ("gateway", {}, ()), ("decode", {"SCD_ALLOCATOR": "system"}, ()), ("decode", {"SCD_ALLOCATOR_CHOSEN": "system"}, ()),
    ("decode", {}, ("--device", "cuda")), ("prefill", {}, ("--device=cuda:1",)), ("decode", {"SCD_DEVICE": "cuda"}, ())])
def test_other_commands_gpu_workers_the_system_choice_and_a_choice_made_already_run_as_they_are(command, env, args):
    env.setdefault("SCD_ALLOCATOR", str(LIBGOMP))
    [shown] = run_show(command, env, *args)
    assert shown["preload"] == "" and not shown["mapped"]


@pytest.mark.skipif(not allocator.find_tcmalloc(), reason="tcmalloc not installed (apt: libtcmalloc-minimal4)")
def test_auto_preloads_tcmalloc_where_the_machine_has_it_and_the_process_says_so():
    [shown] = run_show("prefill", {})
    assert "libtcmalloc" in shown["preload"] and shown["loaded"] == "tcmalloc"
    [shown] = run_show("prefill", {"SCD_ALLOCATOR": "system"})
    assert shown["loaded"] == "system"
