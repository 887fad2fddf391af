"""A PULL reply's encoding alone: 100 deliveries from the fence reply to RESP bytes, for
bodies in the older msgpack form (decoded into a Delivery, then encoded) and in the RESP
form (relayed), and the cost of packing a body at publish in each form.

    python -m bench.delivery_encoding [--size 128] [--out bench/results]

CPU time per message, best of 5. Writes <out>/delivery_encoding.json.
"""

from __future__ import annotations

import argparse
import json
import time
import zlib
from pathlib import Path

import msgpack

from bench.harness import ROOT
from fencemq.model.messages import pack_body, unpack_delivery
from fencemq.protocol.deliveries import encode_deliveries


def msgpack_body(payload: bytes, headers, qos: int, producer, topic=None) -> bytes:
    """The body as stored before the RESP form."""
    bucket = zlib.crc32((producer or topic or "").encode())
    return b"%d:%d:%s" % (qos, bucket, msgpack.packb([payload, headers or None, qos, producer, topic],
                                                     use_bin_type=True))


def per_message_us(fn, messages: int, seconds: float = 0.5) -> float:
    best = float("inf")
    for _ in range(5):
        rounds, t0 = 0, time.process_time()
        while (elapsed := time.process_time() - t0) < seconds / 5:
            fn()
            rounds += 1
        best = min(best, elapsed / (rounds * messages) * 1e6)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", type=int, default=128)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    opts = ap.parse_args()
    payload = b"p" * opts.size
    rows = {}
    for form, pack in (("msgpack", msgpack_body), ("resp", pack_body)):
        # the fence reply of a PULL COUNT 100: tag, id, acquisitions, stored body per delivery
        reply = [(b"%d" % (9000 + i), 1000 + i, 1, b"1700000000%03d:" % i + pack(payload, None, 1, "producer-1"))
                 for i in range(100)]

        def pull_reply(reply=reply) -> bytes:
            batch = [unpack_delivery("orders", None, 3, tag, msg_id, acq, body) for tag, msg_id, acq, body in reply]
            return encode_deliveries(batch, 2)

        def publish_bodies(pack=pack) -> list[bytes]:
            return [pack(payload, None, 1, "producer-1") for _ in range(100)]

        rows[form] = {"pull_reply_us_per_msg": round(per_message_us(pull_reply, 100), 3),
                      "pack_body_us_per_msg": round(per_message_us(publish_bodies, 100), 3)}
        print(f"{form:<8} PULL reply {rows[form]['pull_reply_us_per_msg']:.2f} us/msg   "
              f"pack_body {rows[form]['pack_body_us_per_msg']:.2f} us/msg")
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "delivery_encoding.json").write_text(json.dumps({"payload_bytes": opts.size, "forms": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
