"""The clients of a cancellation storm, run as their own process (``python storm_client.py URL SPEC OUT``), so
that what the server's event loop sees is the server's work, not the clients' competing for its GIL.

SPEC (JSON): ``prompts`` (token ids), ``lengths`` (max_tokens) and ``drops`` (0: read to the end; k: hang up
after the k-th chunk). OUT gets each request's id (from its chunks), the text it received (its chunks' texts
joined), whether it saw ``[DONE]``, and, for those dropped, the ``time.perf_counter()`` once its connection is
closed (the same clock as the server's on Linux: CLOCK_MONOTONIC).
"""

from __future__ import annotations

import asyncio
import json
import sys
import time

import httpx


async def one(client: httpx.AsyncClient, url: str, spec: dict, i: int, result: dict) -> None:
    body = {"prompt": spec["prompts"][i], "max_tokens": spec["lengths"][i], "temperature": 0, "ignore_eos": True,
            "stream": True}
    chunks, drop_after, text = 0, spec["drops"][i], []
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if line == "data: [DONE]":
                result["done"][i] = True
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            result["ids"][i] = chunk["id"]
            text.append(chunk["choices"][0]["text"])
            result["text"][i] = "".join(text)
            chunks += 1
            if chunks == drop_after:
                break  # leaving the block closes the connection mid-stream
    if chunks == drop_after:  # the moment the connection is closed: the server may hear of it from now on
        result["dropped_at"][i] = time.perf_counter()


async def main(url: str, spec: dict) -> dict:
    result: dict = {"ids": {}, "text": {}, "done": {}, "dropped_at": {}}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        await asyncio.gather(*(one(client, url, spec, i, result) for i in range(len(spec["prompts"]))))
    return result


if __name__ == "__main__":
    url, spec_file, out_file = sys.argv[1:4]
    with open(spec_file) as f:
        spec = json.load(f)
    outcome = asyncio.run(asyncio.wait_for(main(url, spec), timeout=180))
    with open(out_file, "w") as f:
        json.dump(outcome, f)
