"""Real `scd-serve` processes for the reliability tests, started through rel_launch.py (which
composes the fault wrappers of scd_serve.testing.faults into the process)."""

import asyncio
import os
import pathlib
import re
import subprocess
import sys
import time

LAUNCH = pathlib.Path(__file__).with_name("rel_launch.py")


class Proc:
    """One `scd-serve` process started through rel_launch.py; `port` once it printed its address."""

    def __init__(self, tmp_path, command, faults=()):
        self.log = tmp_path / f"{command[0]}-{time.monotonic_ns()}.log"
        env = os.environ | {"OMP_NUM_THREADS": "1", "SCD_LOG_LEVEL": "WARNING", "PYTHONUNBUFFERED": "1",
                            "TOKENIZERS_PARALLELISM": "false"}
        self.err = open(self.log, "w")
        self.p = subprocess.Popen([sys.executable, str(LAUNCH), *faults, "--", *command], stdout=subprocess.PIPE,
                                  stderr=self.err, text=True, env=env, start_new_session=True)
        self.port = None

    async def started(self, timeout=90.0) -> int:
        loop = asyncio.get_running_loop()
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            line = await asyncio.wait_for(loop.run_in_executor(None, self.p.stdout.readline), end - time.monotonic())
            if not line:
                raise RuntimeError(f"process exited: {self.log.read_text()[-2000:]}")
            m = re.search(r"serving (?:on |http://)[\d.]+:(\d+)", line)
            if m:
                self.port = int(m.group(1))
                return self.port
        raise TimeoutError("process did not start")

    async def exited(self, timeout: float) -> int | None:
        end = time.monotonic() + timeout
        while self.p.poll() is None and time.monotonic() < end:
            await asyncio.sleep(0.05)
        return self.p.poll()

    def stop(self):
        if self.p.poll() is None:
            self.p.kill()
        self.p.wait(10)
        self.p.stdout.close()
        self.err.close()
