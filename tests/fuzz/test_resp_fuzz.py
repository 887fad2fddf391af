"""A grammar-aware RESP fuzzer against a live worker.

Frames are built from the command table (each verb's own keywords, a real
handle and forged ones, edge-case integers, names and filters, raw bytes),
sent one by one on a named session; every frame the worker refuses must
leave Redis exactly as it was (a snapshot of every key before and after).
Malformed framing goes to throwaway connections, which must be refused and
closed without a trace. A well-behaved client publishes, pulls and acks on
its own topic throughout and must get every reply right.

``FENCEMQ_FUZZ_EXAMPLES`` sets the number of hypothesis examples (60 frames
each; the default 350 sends >= 20,000 frames). The codec alone is fuzzed for
longer with atheris: tests/fuzz/atheris_codec.py (docs/security.md).
"""

from __future__ import annotations

import os
import re
import socket
import threading
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fencemq.protocol.commands import COMMANDS
from tests.helpers import Closed, Err, RespConn, as_map, deliveries, direct, encode_command, free_port, subprocess_worker

EXAMPLES = int(os.environ.get("FENCEMQ_FUZZ_EXAMPLES", "350"))
FRAMES_PER_EXAMPLE = 60
# Verbs that end or reshape the connection itself (their own tests cover them).
SKIPPED = {"QUIT", "RESET", "MULTI", "EXEC", "DISCARD"}
VERBS = sorted(set(COMMANDS) - SKIPPED)
TOKENS = {verb: sorted(set(re.findall(r"\b[A-Z][A-Z-]+\b", c.syntax))) for verb, c in COMMANDS.items()}

# One snapshot of the whole keyspace, each key with a digest of its DUMP (a difference names its
# keys), but for the keys that change by themselves (the lease
# deadlines a worker refreshes, the lease schedule, the health watcher's history, alarms and
# Redis nodes) and the well-behaved client's (its share of the totals the fences keep included).
SNAPSHOT = """
local keys = redis.call('KEYS', '*')
table.sort(keys)
local out = {}
for _, k in ipairs(keys) do
  if not (k:find('good', 1, true) or k:match('^fmq:{?workers') or k:match('^fmq:{?sessions')
          or k:match('^fmq:{?schedule') or k:match('^fmq:sess:{[^}]*}$') or k:match('^fmq:history:')
          or k:match('^fmq:health:') or k:match('^fmq:alarms$') or k:match('^fmq:redis:nodes$')) then
    local body
    if k:match(':totals$') or k:match(':backlogs$') then
      -- the broker-wide figures move with the well-behaved client: only other entries' own count
      local flat = k:match(':totals$') and redis.call('HGETALL', k) or redis.call('ZRANGE', k, 0, -1, 'WITHSCORES')
      local kept = {}
      for i = 1, #flat, 2 do
        local name = flat[i]
        if not name:find('good', 1, true) and (k:match(':backlogs$') or name:find('|', 1, true)) then
          kept[#kept + 1] = name .. '=' .. flat[i + 1]
        end
      end
      table.sort(kept)
      body = table.concat(kept, ',')
    else
      body = redis.call('DUMP', k) or ''
    end
    out[#out + 1] = k .. '=' .. redis.sha1hex(body)
  end
end
return out
"""

NUMBERS = [b"0", b"1", b"2", b"-1", b"1000", b"1001", b"9007199254740991", b"9007199254740992",
           b"99999999999999999999", b"1e3", b" 1", b"0x10", b""]
NAMES = [b"orders", b"g", b"a/b", b"a/+", b"a/#", b"#", b"+", b"$share/g/a/+", b"$share//x", b"a/#/b", b"",
         b"x" * 600, b"bad name", b"with|bar", "é".encode(), b"\xff\xfe", b"\x00", b"fuzz", b"good"]


class Choices:
    """Reads decisions off hypothesis' bytes: one draw per frame keeps generation cheap, and
    hypothesis still shrinks a failing frame (smaller bytes, earlier choices, shorter frames)."""

    def __init__(self, data: bytes) -> None:
        self.data, self.i = data, 0

    def pick(self, n: int) -> int:
        if self.i >= len(self.data):
            return 0
        self.i += 1
        return self.data[self.i - 1] % n

    def take(self, n: int) -> bytes:
        chunk = self.data[self.i : self.i + n]
        self.i += n
        return chunk


def frame(data: bytes, handles: list[bytes]) -> list[bytes]:
    """A frame built from the grammar: a verb (or junk), then words its syntax knows, values at the edges."""
    c = Choices(data)
    if c.pick(8) == 0:  # an unknown verb
        return [c.take(c.pick(12) + 1) or b"?"]
    verb = VERBS[c.pick(len(VERBS))]
    tokens = [t.encode() for t in TOKENS[verb]] or [b"X"]
    args = [verb.encode() if c.pick(4) else verb.lower().encode()]
    for _ in range(c.pick(10)):
        kind = c.pick(7)
        if kind <= 1:
            word = tokens[c.pick(len(tokens))]
            args.append(word if kind == 0 else word.lower())
        elif kind == 2:
            args.append(NUMBERS[c.pick(len(NUMBERS))])
        elif kind == 3:
            args.append(NAMES[c.pick(len(NAMES))])
        elif kind == 4:
            args.append(handles[c.pick(len(handles))])
        else:
            args.append(c.take(c.pick(16)))
    return args


FRAMES = st.binary(min_size=24, max_size=24)


MALFORMED = st.one_of(
    st.sampled_from([b"*2\r\n$4\r\nPING\r\n:1\r\n", b"*1\r\n$4\r\nPINGXX", b"*-5\r\n", b"*abc\r\n",
                     b"$5\r\nhello\r\n", b"*1\r\n$-1\r\n", b"*1\r\n$99999999999\r\n", b'PING "unbalanced\r\n',
                     b"*3\r\n$3\r\nPUB\r\n$1\r\na\r\n$1\r\nbQQ\r\n", b"*100000000\r\n", b"\x00" * 70000]),
    st.binary(min_size=1, max_size=64).map(lambda b: b"*" + b),
)


class GoodClient(threading.Thread):
    """Publishes, pulls and acks on its own topic, checking each reply, until told to stop."""

    def __init__(self, port: int) -> None:
        super().__init__(daemon=True)
        self.port, self.rounds, self.failure, self.stop = port, 0, None, threading.Event()
        self.slowest = 0.0

    def run(self) -> None:
        try:
            with RespConn(self.port, timeout=10) as c:
                c.call("HELLO", 2, "SETNAME", "good")
                h = as_map(c.call("SUB", "good", "GROUP", "good"))["handle"]
                while not self.stop.is_set():
                    started = time.monotonic()
                    payload = f"m{self.rounds}"
                    assert not isinstance(c.call("PUB", "good", payload), Err)
                    got = deliveries(c.call("PULL", h, "COUNT", 1))
                    assert [d["payload"] for d in got] == [payload], got
                    assert c.call("ACK", h, got[0]["tag"]) == 1
                    self.slowest = max(self.slowest, time.monotonic() - started)
                    self.rounds += 1
                    self.stop.wait(0.005)  # a steady client, not a second flood
        except BaseException as exc:  # surfaced by the test
            self.failure = exc


@pytest.fixture
def fuzzed(redis_url):
    # the worker in a process of its own: the fuzzer's Python does not slow it down, nor it the fuzzer
    port = free_port()
    # No sweeps: a lease the fuzzer shortened (RENEW … LOCK 1) must not come back, and change Redis,
    # between the two snapshots around a refused frame.
    proc = subprocess_worker(redis_url, port, max_block_ms=1, sweep_interval_ms=3_600_000)
    good = GoodClient(port)
    good.start()
    try:
        yield port, direct(redis_url), good
    finally:
        good.stop.set()
        good.join(10)
        proc.terminate()
        proc.wait(10)


def snapshot(r) -> frozenset[bytes]:
    return frozenset(r.eval(SNAPSHOT, 0))


def test_rejected_frames_change_nothing_and_the_worker_serves_everyone_throughout(fuzzed) -> None:
    port, r, good = fuzzed
    c = RespConn(port, timeout=10, raw=True)
    c.call("HELLO", 2, "SETNAME", "fuzz")
    real = as_map(c.call("SUB", "orders", "GROUP", "g"))["handle"].encode()
    c.call("PUB", "orders", "seed")
    forged = real.split(b".")[0] + b"." + b"A" * 16
    handles = [real, forged, real.split(b".")[0], real[:-1], b"h" + b"A" * 40, b"hx.y"]
    sent = {"frames": 0, "rejected": 0}

    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(st.lists(FRAMES, min_size=FRAMES_PER_EXAMPLE, max_size=FRAMES_PER_EXAMPLE),
           st.lists(MALFORMED, max_size=1))
    def run(batch: list[bytes], malformed: list[bytes]) -> None:
        before = snapshot(r)
        for choices in batch:
            args = frame(choices, handles)
            c.send_raw(encode_command(*args))
            reply = c.reply()
            sent["frames"] += 1
            if isinstance(reply, Err):
                sent["rejected"] += 1
                assert len(reply) <= 520 and reply.isprintable(), reply
                after = snapshot(r)
                assert after == before, f"{args!r} was refused ({reply}) yet changed Redis: {sorted(after ^ before)}"
            else:
                after = snapshot(r)
            before = after
        for junk in malformed:
            with RespConn(port, timeout=10, raw=True) as throwaway:
                before = snapshot(r)
                throwaway.send_raw(junk)
                throwaway.sock.shutdown(socket.SHUT_WR)  # an incomplete frame ends here: no waiting for more
                try:
                    reply = throwaway.reply(timeout=5)
                except (OSError, Closed):
                    reply = None
                sent["frames"] += 1
                assert reply is None or isinstance(reply, (Err, str, bytes)), reply
                after = snapshot(r)
                assert after == before, f"malformed {junk[:40]!r} changed Redis: {sorted(after ^ before)}"
        assert good.failure is None, f"the well-behaved client failed: {good.failure!r}"

    try:
        run()
    finally:
        c.close()
    assert sent["frames"] >= FRAMES_PER_EXAMPLE * EXAMPLES
    assert sent["rejected"] > sent["frames"] // 10, "the fuzzer should mostly reach the worker's refusals"
    assert good.rounds > 100
