"""A prefill worker that exits (os._exit, as a killed process would) when its first transfer's
second chunk is due: `python dying_prefill.py MODEL PORT`."""

import asyncio
import sys

from scd_serve import codec as codec_registry
from scd_serve.config.prefill import PrefillConfig
from scd_serve.model.runtime import ModelRuntime
from scd_serve.prefill.worker import PrefillWorker
from scd_serve.testing.faults import FaultyServicer


async def main(model: str, port: int) -> None:
    rt = ModelRuntime.load(model)
    config = PrefillConfig(model=model, host="127.0.0.1", port=port)
    worker = PrefillWorker(rt, {"identity": codec_registry.build("identity", producer=rt)}, config,
                           servicer_wrap=lambda sv: FaultyServicer(sv, exit_at_chunk=1))
    await worker.start()
    print(f"serving on {worker.address}; exiting mid-stream at the first transfer's chunk 1", flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], int(sys.argv[2])))
