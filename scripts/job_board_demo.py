"""Demo: two worker processes share one job board through a Pulsar topic.

The main process posts jobs; two workers (separate OS processes) claim them with generator
writes: a worker's generator picks the lowest open job from the up-to-date state, so no job is
ever claimed twice even though both workers race. At the end every replica holds the same
state, and the program checks it.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import multiprocessing
import os
import sys
import time
from typing import Any

from pulsar_state import SharedStateManager

Board = dict[str, Any]
JOBS = 30


def new_board() -> Board:
    return {"jobs": {}}


def apply(board: Board, op: dict[str, Any]) -> None:
    jobs = board["jobs"]
    if op["op"] == "post":
        for job in op["ids"]:
            jobs[str(job)] = {"status": "open", "by": None}
    elif op["op"] == "claim":
        job = jobs[op["id"]]
        if job["status"] != "open":
            raise ValueError(f"job {op['id']} is not open")
        job.update(status="claimed", by=op["by"])
    elif op["op"] == "done":
        jobs[op["id"]]["status"] = "done"
    else:
        raise ValueError(f"unknown op {op['op']!r}")


def digest(board: Board) -> str:
    return hashlib.sha256(json.dumps(board, sort_keys=True).encode()).hexdigest()[:12]


def manager(url: str, topic: str, name: str) -> SharedStateManager[Board, dict[str, Any]]:
    return SharedStateManager(url, topic, initial_state=new_board, apply=apply, name=name)


def claim_next(worker: str):  # type: ignore[no-untyped-def]
    def generator(board: Board) -> list[dict[str, Any]]:
        open_jobs = sorted((j for j, v in board["jobs"].items() if v["status"] == "open"), key=int)
        return [{"op": "claim", "id": open_jobs[0], "by": worker}] if open_jobs else []

    return generator


def status_of(job: str):  # type: ignore[no-untyped-def]
    return lambda board: board["jobs"][job]["status"]


async def work(url: str, topic: str, worker: str) -> None:
    async with manager(url, topic, worker) as board:
        while True:
            result = await board.write(
                claim_next(worker),
                reader=lambda b: [j for j, v in b["jobs"].items() if v["by"] == worker],
            )
            claimed = [j for j in result.value if await board.read(status_of(j)) == "claimed"]
            if not claimed:
                break
            job = claimed[0]
            print(
                f"  [{worker}] claimed job {job:>2}  (log position {result.position})", flush=True
            )
            await asyncio.sleep(0.02)  # the "work"
            await board.write_ops([{"op": "done", "id": job}])
        count = await board.read(lambda b: sum(v["by"] == worker for v in b["jobs"].values()))
        print(f"  [{worker}] no open jobs left; it did {count}", flush=True)


def worker_main(url: str, topic: str, worker: str) -> None:
    logging.basicConfig(level=logging.WARNING)
    asyncio.run(work(url, topic, worker))


async def main(url: str) -> int:
    topic = f"demo-jobs-{int(time.time())}-{os.getpid()}"
    print(f"pulsar-state demo: a job board on topic {topic} at {url}")
    async with manager(url, topic, "main") as board:
        await board.write_ops([{"op": "post", "ids": list(range(1, JOBS + 1))}])
        print(f"posted {JOBS} jobs; starting two worker processes")
        context = multiprocessing.get_context("spawn")
        workers = [
            context.Process(target=worker_main, args=(url, topic, name))
            for name in ("worker-a", "worker-b")
        ]
        for process in workers:
            process.start()
        for process in workers:
            # Never block the event loop: it releases this process's hold on the writer.
            await asyncio.to_thread(process.join, 300)
        state = await board.read(lambda b: b, latest=True)
        jobs = state["jobs"]
        by_worker: dict[str, int] = {}
        for job in jobs.values():
            by_worker[job["by"]] = by_worker.get(job["by"], 0) + 1
        ok = all(j["status"] == "done" for j in jobs.values()) and len(jobs) == JOBS
        ok = ok and all(p.exitcode == 0 for p in workers)
        print(f"main replica digest {digest(state)}; jobs per worker: {by_worker}")
        print(f"records applied: {board.position}; every job done exactly once: {ok}")
        return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(asyncio.run(main(os.environ.get("PULSAR_SERVICE_URL", "pulsar://127.0.0.1:6650"))))
