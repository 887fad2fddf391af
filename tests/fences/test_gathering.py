"""Calls gathered into batches: every caller gets its own result, whatever happens to the others."""

from __future__ import annotations

import anyio
import pytest

from fencemq.errors import FenceMQError
from fencemq.fences.gathering import Gathering


def run_gathered(body) -> None:
    async def main() -> None:
        async with anyio.create_task_group() as tg:
            await body(tg)

    anyio.run(main)


def test_concurrent_calls_go_out_in_few_batches_and_each_caller_gets_its_own_result():
    seen: list[list[int]] = []

    async def double(items: list[int]) -> list[int]:
        seen.append(items)
        await anyio.sleep(0.01)  # a round trip: newcomers gather for the next batch meanwhile
        return [2 * i for i in items]

    async def body(tg) -> None:
        gathering = Gathering(double, lambda: tg.start_soon)
        results: dict[int, int] = {}

        async def one(i: int) -> None:
            results[i] = await gathering(i)

        async with anyio.create_task_group() as calls:
            for i in range(300):
                calls.start_soon(one, i)
        assert results == {i: 2 * i for i in range(300)}
        assert gathering.batches <= 3, [len(b) for b in seen]
        assert sorted(i for b in seen for i in b) == list(range(300)), "every call ran once"

    run_gathered(body)


def test_an_error_in_one_slot_goes_to_its_caller_alone_and_a_failed_batch_to_all_of_its_callers():
    async def picky(items: list[int]) -> list[object]:
        if 13 in items:
            raise FenceMQError("Redis did not answer")
        return [ValueError(f"odd {i}") if i % 2 else i for i in items]

    async def body(tg) -> None:
        gathering = Gathering(picky, lambda: tg.start_soon)
        outcome: dict[int, object] = {}

        async def one(i: int) -> None:
            try:
                outcome[i] = await gathering(i)
            except Exception as exc:  # noqa: BLE001
                outcome[i] = exc

        async with anyio.create_task_group() as calls:
            for i in range(4):
                calls.start_soon(one, i)
        assert outcome[0] == 0 and outcome[2] == 2
        assert isinstance(outcome[1], ValueError) and isinstance(outcome[3], ValueError)
        with pytest.raises(FenceMQError):
            await gathering(13)
        assert await gathering(4) == 4, "a failed batch leaves the next ones alone"

    run_gathered(body)


def test_a_caller_that_stops_waiting_leaves_the_batch_and_the_other_callers_alone():
    ran: list[int] = []

    async def slow(items: list[int]) -> list[int]:
        await anyio.sleep(0.05)
        ran.extend(items)
        return items

    async def body(tg) -> None:
        gathering = Gathering(slow, lambda: tg.start_soon)
        got: list[int] = []

        async def patient(i: int) -> None:
            got.append(await gathering(i))

        async def impatient() -> None:
            with anyio.move_on_after(0.01):
                await gathering(99)

        async with anyio.create_task_group() as calls:
            calls.start_soon(patient, 1)
            calls.start_soon(impatient)
            calls.start_soon(patient, 2)
        assert sorted(got) == [1, 2]
        assert sorted(ran) == [1, 2, 99], "the call was sent; only its answer went unread"

    run_gathered(body)


def test_without_spawn_each_call_runs_alone_through_the_same_batch_function():
    async def main() -> None:
        batches: list[list[int]] = []

        async def record(items: list[int]) -> list[int]:
            batches.append(items)
            return items

        gathering = Gathering(record, lambda: None)
        assert [await gathering(i) for i in range(3)] == [0, 1, 2]
        assert batches == [[0], [1], [2]]

    anyio.run(main)
