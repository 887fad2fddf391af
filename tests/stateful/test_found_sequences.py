"""Sequences the model-based test found, replayed move by move with their timing made certain.

Each drives the moves of tests/stateful/test_guarantees.py (its machine, workers and checks) in the
order a failing run made them, with the step that load once made likely (a lease running out, a
sweeper's dispatch landing between two reads) brought about on purpose instead.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis

from fencemq.model import meta as fields
from tests.helpers import wait_for
from tests.stateful.test_guarantees import KEYS, LOCK_MS, Guarantees, Workers


class Drawn:
    """What a rule's ``data.draw`` gets, by label: the values the failing sequence drew."""

    def __init__(self, **by_label: Any) -> None:
        self.by_label = by_label

    def draw(self, strategy: Any, label: str | None = None) -> Any:
        return self.by_label[label]


class Replayed(Guarantees):
    """The machine, with a hook run once right after the next read of a queue's state: what happened
    meanwhile in the failing run."""

    meanwhile: Callable[[], None] | None = None

    def group_state(self, target: str) -> dict[str, str]:
        state = super().group_state(target)
        hook, self.meanwhile = self.meanwhile, None
        if hook is not None:
            hook()
        return state


@pytest.fixture
def machine(redis_url) -> Iterator[Replayed]:
    workers = Workers(redis_url)
    direct = redis.Redis.from_url(redis_url)
    m = type("ReplayedMachine", (Replayed,), {"workers": workers, "redis": direct})()
    try:
        yield m
    finally:
        m.teardown()
        workers.stop()
        direct.close()


def share_field(m: Replayed, name: str, member: str | None = None) -> str:
    return fields.member_field("s", member, name) if member else fields.group_field("s", name)


def test_a_share_member_whose_leases_ran_out_ends_its_stream_at_its_unsub(machine) -> None:
    """Found with 4 shards on 2 cores: its mailbox entries (leased: the group has two members) outlived
    LOCK before it UNSUBscribed, so it was suspected, and its TAKE after the UNSUB answered nil, not EOS."""
    m = machine
    m.subscribe(0, "share")
    m.subscribe(1, "share")
    m.publish("share", 4)  # two in each member's mailbox, leased for LOCK_MS
    meta = KEYS.queue(m.queues["share"]).meta
    suspected = share_field(m, fields.SUSPECTED_SINCE, m.consumers[0].cid)
    wait_for(lambda: m.redis.hexists(meta, suspected), timeout=10 * LOCK_MS / 1000, what="the member's suspicion")
    m.unsubscribe(0, "share")  # asserts TAKE answers EOS
    m.nothing_names_a_client_whose_session_is_gone()
    m.the_totals_equal_a_full_count()


def test_a_refused_sub_is_not_blamed_for_what_a_sweepers_dispatch_moved_meanwhile(machine) -> None:
    """Found with 4 shards on 2 cores: a message published for later was released by a sweeper, and its
    dispatch moved the $share group's cursor and round-robin pointer, between the two reads around a SUB
    the worker refused while parsing it (MAX above 2^53 - 1: no fence ran): 'changed {g|s|cur, g|s|rr}'."""
    m = machine
    m.subscribe(0, "share")
    m.subscribe(1, "share")
    m.publish_for_later_or_expiring("share", 1, 300, None, False, None)
    cursor = share_field(m, fields.CURSOR)
    at_first = m.group_state("share")[cursor]
    m.meanwhile = lambda: wait_for(lambda: Guarantees.group_state(m, "share")[cursor] != at_first, timeout=10,
                                   what="the release's dispatch")
    m.send_a_number_out_of_range(2, "share", Drawn(number=2**63 - 1, command=[
        "SUB", *m.subscribe_args("share"), "MAX", 2**63 - 1]))
    assert m.group_state("share")[cursor] != at_first  # the dispatch did land between the two reads


def test_a_refused_command_that_moved_a_push_groups_cursor_itself_is_still_caught(machine) -> None:
    """The excuse above holds only where a dispatch is seen (a delivery counted, or an expiry): a cursor
    that moves with nothing delivered, as a fence writing before it refuses would move it, fails the check."""
    m = machine
    m.subscribe(0, "share")
    m.subscribe(1, "share")
    m.publish("share", 2)
    meta = KEYS.queue(m.queues["share"]).meta
    m.meanwhile = lambda: m.redis.hincrby(meta, share_field(m, fields.CURSOR), 1)
    with pytest.raises(AssertionError, match=r"SUB with 9223372036854775807 was refused but changed \{'g\|s\|cur'\}"):
        m.send_a_number_out_of_range(2, "share", Drawn(number=2**63 - 1, command=[
            "SUB", *m.subscribe_args("share"), "MAX", 2**63 - 1]))


def test_a_filter_queue_numbers_its_own_copies_from_its_subscription_on(machine) -> None:
    """Found at 1,000 sequences (twice, 4 shards): two messages published to the filter topic before the
    $share SUB (never copied: the filter queue's first copy is its first id), two published for later with no
    delay (checked by payload), two more: the filter queue's third id held the third publish's first message,
    and the model, which took the topic's ids for the filter queue's, said 'delivered 3, which was never
    published'. The model now checks what reaches a filter queue by payload."""
    m = machine
    m.start_with_some_members_and_messages([(1, "share")], [("share", 2)])
    m.publish_for_later_or_expiring("share", 2, 0, None, False, None)
    m.publish("share", 2)
    log = KEYS.queue(m.queues["share"]).log
    ids = sorted(int(i) for i in m.redis.hkeys(log))  # a filter queue's start at the clock (lib/meta.lua)
    assert len(ids) == 4 and ids == list(range(ids[0], ids[0] + 4)), "the two published before the SUB were not copied"
    m.pull(1, "share", 3)  # the filter queue's first 3 ids: two published for later, then the third publish's first
    assert [mid for _, mid, _ in m.consumers[1].fetched["share"]] == ids[:3]
