"""A disk-backed PulsarMap replica writing hard until it is killed:
``python -m tests.recipes.disk_worker URL ADMIN TOPIC STORE SEED``.

Opens the map on its local store, prints ``{"ready": position, "resumed": ...,
"records_read": ...}``, then writes random records (puts, deletes, now and then a clear) over a
small key space as fast as it can, forever: the test SIGKILLs it at a random moment.
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
from typing import Any

from recipes import DiskStore, PulsarMap

WAIT_S = 60.0
KEYS = [f"k{i:03d}" for i in range(200)]


async def main(url: str, admin: str, topic: str, store: str, seed: int) -> None:
    rng = random.Random(seed)
    async with PulsarMap(
        url,
        topic,
        admin_url=admin,
        store=DiskStore(store, cache_bytes=16_384),
        name="disk-worker",
        write_timeout_s=WAIT_S,
        read_timeout_s=WAIT_S,
        open_timeout_s=WAIT_S,
        idle_release_s=5.0,
        max_hold_s=60.0,
    ) as m:
        stats = m.stats
        print(
            json.dumps(
                {
                    "ready": m.position,
                    "resumed": stats.resumed_position,
                    "records_read": stats.records_read,
                }
            ),
            flush=True,
        )
        while True:
            roll = rng.random()
            if roll < 0.01:
                await m.clear()
            elif roll < 0.2:
                await m.delete(rng.choice(KEYS))
            else:
                batches: list[dict[str, Any]] = [
                    {
                        rng.choice(KEYS): {"n": rng.randrange(1000), "s": "x" * rng.randrange(80)}
                        for _ in range(rng.randrange(1, 20))
                    }
                    for _ in range(4)
                ]
                # Writes in flight together: pipelined records, some of several writes.
                await asyncio.gather(
                    *(m.put_all(batch) for batch in batches),
                    *(m.put(rng.choice(KEYS), rng.randrange(10**6)) for _ in range(4)),
                )


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:5], int(sys.argv[5])))
