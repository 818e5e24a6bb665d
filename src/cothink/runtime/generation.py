"""A running generation, as the user holds it: iterate it, collect it, cancel, pause or resume it."""

from __future__ import annotations

import asyncio
from typing import AsyncIterator, Callable, Literal

from cothink.scheduler.scheduler import Scheduler
from cothink.scheduler.work import GenerateWork, GenerationResult, Piece


Control = Literal["cancel", "pause", "resume"]


class Generation:
    """A running generation: iterate for Pieces, or `await collect()` for the whole result.

    Iterating yields every token of the result in a Piece (GenerateWork states the protocol), also
    after `cancel()`: the pieces of tokens written before it still come, then the iteration ends.
    Cancelling the task that iterates it (or `cancel()`) ends it and frees its block at once;
    `pause()` / `resume()` stop and continue it without losing any state.
    """

    def __init__(self, work: GenerateWork, scheduler: Scheduler):
        self._work, self._scheduler = work, scheduler
        self._consumers: set[asyncio.Task] = set()
        self.result: GenerationResult | None = None
        self._drained = False  # the queue's GenerationResult was taken: nothing more will come
        self._observers: list[Callable[[Control], None]] = []

    @property
    def name(self) -> str:
        return self._work.coroutine

    @property
    def paused(self) -> bool:
        return self._work.paused

    def __aiter__(self) -> AsyncIterator[Piece]:
        self._watch_consumer()
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[Piece]:
        try:
            while not self._drained:  # not `self.result`: cancel() sets it before the last pieces come
                event = await self._work.queue.get()
                if isinstance(event, BaseException):
                    raise event
                if isinstance(event, GenerationResult):
                    self.result, self._drained = event, True
                    return
                if event.text or event.token_ids:
                    yield event
        finally:
            if self.result is None:  # the consumer was cancelled or stopped early
                self.cancel()
            self._unwatch_consumers()

    def _watch_consumer(self) -> None:
        """When the task iterating this generation ends (say it was cancelled while busy in its
        loop body), the generation ends too, before anyone awaiting that task resumes: done
        callbacks run in the order they were added, and this one was added first."""
        task = asyncio.current_task()
        if task is not None and task not in self._consumers:
            self._consumers.add(task)
            task.add_done_callback(self._consumer_done)

    def _consumer_done(self, task: asyncio.Task) -> None:
        self._consumers.discard(task)
        self.cancel()

    def _unwatch_consumers(self) -> None:
        for task in self._consumers:
            task.remove_done_callback(self._consumer_done)
        self._consumers.clear()

    async def collect(self) -> GenerationResult:
        async for _ in self:
            pass
        assert self.result is not None
        return self.result

    def observe(self, callback: Callable[[Control], None]) -> None:
        """Call `callback(control)` before each cancel, pause or resume that changes the generation's
        state, including the implicit cancel when its consumer task ends (a recorder logs them)."""
        self._observers.append(callback)

    def _notify(self, control: Control) -> None:
        for callback in self._observers:
            callback(control)

    def cancel(self) -> None:
        """End the generation; its block can be written again as soon as this returns."""
        work = self._work
        if not work.finished:
            self._notify("cancel")
            self._scheduler.cancel(work)
        if self.result is None and work.outcome == "cancelled":
            self.result = work.result("cancelled")

    def pause(self) -> None:
        """Stop before the next step, keeping the sampled token, sampler state and token budget.
        The block stays reserved for this generation (other writers get BlockBusyError)."""
        if not self._work.finished and not self._work.paused:
            self._notify("pause")
        self._scheduler.set_paused(self._work, True)

    def resume(self) -> None:
        if not self._work.finished and self._work.paused:
            self._notify("resume")
        self._scheduler.set_paused(self._work, False)

    async def __aenter__(self) -> Generation:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.cancel()
