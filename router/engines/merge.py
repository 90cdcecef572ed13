"""Interleave several async generators into one, in arrival order, each item tagged.

Invariants: an item arrives as soon as its source produces it; the first exception from any
source is raised to the consumer; when the consumer stops (finished, error, closed early)
every source is closed, so nothing they hold (engine calls, streams) outlives the merge.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Sequence
from typing import TypeVar

T = TypeVar("T")


async def merge_tagged(
    sources: Sequence[AsyncGenerator[T, None]],
) -> AsyncGenerator[tuple[int, T], None]:
    if len(sources) == 1:
        async with contextlib.aclosing(sources[0]) as only:
            async for item in only:
                yield 0, item
        return
    queue: asyncio.Queue[tuple[int, T] | BaseException | None] = asyncio.Queue()

    async def pump(index: int, source: AsyncGenerator[T, None]) -> None:
        try:
            async with contextlib.aclosing(source):
                async for value in source:
                    queue.put_nowait((index, value))
            queue.put_nowait(None)
        except Exception as exc:  # handed to the consumer, which re-raises it
            queue.put_nowait(exc)

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(sources)]
    try:
        remaining = len(tasks)
        while remaining:
            got = await queue.get()
            if got is None:
                remaining -= 1
            elif isinstance(got, BaseException):
                raise got
            else:
                yield got
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
