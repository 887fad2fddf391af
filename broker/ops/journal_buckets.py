"""The snapshot's journal, bucketed by queue the way Spark hash-partitions it.

The analytics job groups and joins the journal per queue. Read as one file,
Spark has to shuffle every journal row to the task that owns its queue (at
10M lmqs / 100M events, half the job's time went there). Written as
``buckets`` files, each holding the queues whose id hashes to it exactly as
Spark's own ``HashPartitioning(queue, buckets)`` would place them, the job
declares the directory a bucketed table and Spark plans no shuffle of the
journal at all: every task reads one bucket, and the small tables (groups,
members) are shuffled to it instead (spark/analytics.py ``load_tables``).

Spark places a row in ``pmod(murmur3_x86_32(queue's UTF-8 bytes, seed 42),
buckets)``, with Spark's own tail rule (each of the last ``len % 4`` bytes is
mixed in alone, sign-extended), which differs from the reference Murmur3:
the same hash, bit for bit, is computed here (tests/spark holds both
functions against Spark's ``hash()``). A file's bucket is the number after
its last ``_`` (``bucket_00003.parquet``), as Spark reads it.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa

__all__ = ["DEFAULT_BUCKETS", "bucket_file", "bucket_of", "buckets_of", "spark_hash", "split", "write_buckets"]

DEFAULT_BUCKETS = 8  # the job's default shuffle partitions: one task per bucket, none repartitioned
SEED = 42  # Spark's Murmur3Hash seed
_C1, _C2, _M = 0xCC9E2D51, 0x1B873593, 0xFFFFFFFF


def bucket_file(bucket: int) -> str:
    return f"bucket_{bucket:05d}.parquet"


def _mix(h: int, k: int) -> int:
    k = (k * _C1) & _M
    k = ((k << 15) | (k >> 17)) & _M
    k = (k * _C2) & _M
    h ^= k
    h = ((h << 13) | (h >> 19)) & _M
    return (h * 5 + 0xE6546B64) & _M


def spark_hash(value: str) -> int:
    """Spark's ``hash(value)`` of a string (a signed 32-bit int)."""
    data = value.encode()
    n = len(data)
    aligned = n - n % 4
    h = SEED
    for i in range(0, aligned, 4):
        h = _mix(h, int.from_bytes(data[i:i + 4], "little"))
    for byte in data[aligned:]:
        h = _mix(h, (byte - 256 if byte > 127 else byte) & _M)
    h ^= n
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & _M
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & _M
    h ^= h >> 16
    return h - (1 << 32) if h & 0x80000000 else h


def bucket_of(queue: str, buckets: int) -> int:
    """The bucket of one queue id (Python's % of a positive divisor is Spark's pmod)."""
    return spark_hash(queue) % buckets


def _mix_array(h: np.ndarray, k: np.ndarray) -> np.ndarray:
    k = k * np.uint32(_C1)
    k = (k << np.uint32(15)) | (k >> np.uint32(17))
    k = k * np.uint32(_C2)
    h = h ^ k
    h = (h << np.uint32(13)) | (h >> np.uint32(19))
    return h * np.uint32(5) + np.uint32(0xE6546B64)


def buckets_of(queues: pa.Array | pa.ChunkedArray, buckets: int, chunk: int = 1 << 20) -> np.ndarray:
    """``bucket_of`` of every string of an Arrow array (no nulls), vectorised: int32 per row."""
    if isinstance(queues, pa.ChunkedArray):
        parts = [buckets_of(c, buckets, chunk) for c in queues.chunks]
        return np.concatenate(parts) if parts else np.zeros(0, np.int32)
    queues = queues.cast(pa.large_binary())
    if queues.null_count:
        raise ValueError("queue ids are never null")
    out = np.empty(len(queues), np.int32)
    for lo in range(0, len(queues), chunk):
        part = queues.slice(lo, chunk)
        offsets = np.frombuffer(part.buffers()[1], np.int64)[part.offset:part.offset + len(part) + 1]
        data = np.frombuffer(part.buffers()[2], np.uint8) if part.buffers()[2] is not None else np.zeros(1, np.uint8)
        lengths = np.diff(offsets)
        width = int(lengths.max(initial=0)) + 4  # room for a whole last block
        # one row of bytes per id, zero-padded
        cols = np.arange(width)
        index = offsets[:-1, None] + cols[None, :]
        inside = cols[None, :] < lengths[:, None]
        matrix = np.where(inside, data[np.minimum(index, len(data) - 1)], 0).astype(np.uint32)
        h = np.full(len(part), SEED, np.uint32)
        blocks = lengths // 4
        with np.errstate(over="ignore"):
            for b in range(int(blocks.max(initial=0))):
                k = (matrix[:, 4 * b] | (matrix[:, 4 * b + 1] << np.uint32(8)) | (matrix[:, 4 * b + 2] << np.uint32(16))
                     | (matrix[:, 4 * b + 3] << np.uint32(24)))
                h = np.where(blocks > b, _mix_array(h, k), h)
            rows = np.arange(len(part))
            for t in range(3):
                position = blocks * 4 + t
                byte = matrix[rows, np.minimum(position, width - 1)].astype(np.uint8).view(np.int8)
                h = np.where(position < lengths, _mix_array(h, byte.astype(np.int32).view(np.uint32)), h)
            h = h ^ lengths.astype(np.uint32)
            h ^= h >> np.uint32(16)
            h = h * np.uint32(0x85EBCA6B)
            h ^= h >> np.uint32(13)
            h = h * np.uint32(0xC2B2AE35)
            h ^= h >> np.uint32(16)
        out[lo:lo + len(part)] = np.mod(h.view(np.int32), buckets)
    return out


def split(table: pa.Table, buckets: int) -> list[pa.Table]:
    """The rows of ``table`` (a ``queue`` column first) per bucket, each in its order."""
    row_bucket = buckets_of(table.column("queue"), buckets)
    return [table.filter(pa.array(row_bucket == b)) for b in range(buckets)]


def write_buckets(table: pa.Table, directory: Path, buckets: int) -> None:
    """``table`` as a directory of ``buckets`` Parquet files, as a snapshot writes its journal."""
    import pyarrow.parquet as pq

    directory.mkdir(parents=True, exist_ok=True)
    for b, part in enumerate(split(table, buckets)):
        pq.write_table(part, directory / bucket_file(b))
