"""Async plumbing of the routes: server-sent events, merged output streams, client disconnects."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from http import HTTPStatus
from typing import Generic, TypeVar

from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from cluster.openai.catch_all import current_request_id
from cluster.openai.errors import describe_exception

logger = logging.getLogger(__name__)

T = TypeVar("T")

DONE_EVENT = "data: [DONE]\n\n"


def sse_event(payload: BaseModel) -> str:
    return f"data: {payload.model_dump_json()}\n\n"


async def sse_stream(chunks: AsyncIterator[BaseModel]) -> AsyncIterator[str]:
    """Each chunk as an event, ending with [DONE]; an error after the response has started (the
    status is sent by then) becomes an event in OpenAI's error shape, which clients raise."""
    try:
        async with contextlib.aclosing(chunks):  # type: ignore[type-var]
            async for chunk in chunks:
                yield sse_event(chunk)
    except Exception as exc:
        body = describe_exception(exc)
        if body.error.code == HTTPStatus.INTERNAL_SERVER_ERROR:
            logger.exception("stream of request %s failed", current_request_id())
        yield sse_event(body)
    yield DONE_EVENT


class SSEResponse(StreamingResponse):
    """A stream of server-sent events whose generator is closed as soon as the response ends.

    Starlette stops iterating when the client disconnects, but may leave the generator suspended
    until garbage collection; closing it at once runs its cleanup (aborting the engine requests)
    without delay.
    """

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[str]) -> None:
        super().__init__(content, headers={"Cache-Control": "no-cache"})
        self._events = content

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._events.aclose()  # type: ignore[attr-defined]


async def run_until_disconnect(request: Request, work: Awaitable[T]) -> T | None:
    """Await `work` unless the client disconnects first; then cancel it and return None.

    Cancelling the work closes its engine streams, which aborts the requests and frees their KV
    blocks instead of finishing a generation nobody will read.
    """
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    return task.result() if not task.cancelled() else None


async def _wait_for_disconnect(request: Request) -> None:
    # The body has been read by now, so the next message can only be the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def merge_streams(streams: list[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """Items of several async iterators as they come, tagged with the index of their iterator.

    The first exception of any iterator is raised; leaving early (or failing) cancels the rest.
    """
    if len(streams) == 1:
        async for item in streams[0]:
            yield 0, item
        return
    queue: asyncio.Queue[tuple[int, T | BaseException | None]] = asyncio.Queue()

    async def drain(index: int, stream: AsyncIterator[T]) -> None:
        try:
            async for item in stream:
                queue.put_nowait((index, item))
            queue.put_nowait((index, None))
        except Exception as exc:
            queue.put_nowait((index, exc))

    tasks = [asyncio.create_task(drain(index, stream)) for index, stream in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class PrimedStream(Generic[T]):
    """`first`, then the rest of `rest`: a stream whose first item was awaited before the response
    started. Closing it closes `rest`, even when it was never iterated."""

    def __init__(self, first: T, rest: AsyncIterator[T]) -> None:
        self._first: list[T] = [first]
        self._rest = rest

    def __aiter__(self) -> PrimedStream[T]:
        return self

    async def __anext__(self) -> T:
        if self._first:
            return self._first.pop()
        return await anext(self._rest)

    async def aclose(self) -> None:
        await self._rest.aclose()  # type: ignore[attr-defined]


async def within_deadline(
    items: AsyncIterator[T], timeout_s: float | None, error: Callable[[float], Exception]
) -> AsyncIterator[T]:
    """`items` until `timeout_s` seconds from now, when `error(timeout_s)` is raised instead.

    The wait for the item due at the deadline is cancelled, which closes `items` (and the engine
    streams under it: their requests are aborted). Without a timeout the items pass untouched.
    """
    if timeout_s is None:
        async for item in items:
            yield item
        return
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        try:
            item = await asyncio.wait_for(anext(items), max(0.0, deadline - loop.time()))
        except StopAsyncIteration:
            return
        except TimeoutError:
            raise error(timeout_s) from None
        yield item
