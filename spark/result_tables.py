"""The analytics job's result tables, computed from a snapshot's tables (spark/analytics.py runs them).

The result tables (one Parquet directory each under the job's ``--out``):

* ``backlog``               per topic / lmq / group: unread, ready, delayed,
  checkouts, backlog (= unread + ready) and the oldest unacked message's age
  (snapshot ms - its publish ms; "unacked": checked out, returned, delayed or
  not yet read).
  A priority queue's groups also carry ``unread_by_level`` (ten counts
  indexed by level, 0 first; null for other queues and in snapshots before
  version 3).
* ``backlog_by_topic``      the same rolled up per (topic, group) over its lmqs.
* ``priority_levels``       per priority queue, level and group: the messages
  its index held at the level (``held``) and what the group had not read
  there (``unread``); levels with neither are left out, a queue without
  groups has rows with a null group. Empty for snapshots before version 3.
* ``group_activity``        per (queue, group), journal event counts.
* ``redeliveries``          per group: checkouts (``out`` events), redeliveries
  (``out`` with acquisitions > 1), distinct messages, max acquisitions.
* ``delivery_counts``       distribution: for each acquisitions value n, how
  many ``out`` events carried n, and how many (queue, group, message) were
  delivered n times at most.
* ``consumers``             per (queue, group, member): checkouts, acks, nacks,
  lock expiries (``timeout`` events), suspicions (sweeps that timed it out:
  distinct ``timeout`` ms), suspected now, eviction marker, delivered.
* ``preemptions``           per (queue, group) with any churn: preemptions,
  operator evictions, fenced pulls, owners (clients seen around the churn),
  first/last ms, and where from (``source``: ``meta`` = the counters every
  lmq keeps in its meta hash, journal or not; ``journal``; ``meta+journal``).
  Each figure is the larger of the two: the counters count since the group's
  first churn, the journal only its newest events, but a queue churned before
  the counters existed has only the journal; ``preemptions_by_group`` per
  (topic, group).
* ``seeks``                 per (queue, group) with any: seeks by kind, last
  seek ms, current epoch.
* ``events``                journal events per type.
* ``audit_coverage``        what the audit could prove, per queue kind and
  whether the queue keeps a journal: queues, journal events, checkouts,
  marked (evicted) members. History checks need a journal; state checks run
  on every queue.
* The **fence audit** (each must be empty on a healthy broker). State
  checks, on every queue (journal or not), at its snapshot instant:
  ``audit_marked_holding`` a checkout held by a member with an eviction
  marker (an evicted client must hold nothing: its checkouts go back when it
  is marked, and it is handed nothing until it subscribes again);
  ``audit_stale_checkout`` a checkout whose epoch is below its group's (a
  seek returns every checkout of the group). History checks, on queues with
  a journal, in the
  journal's commit order (its ``seq`` column: position in the queue's list,
  never ms, which ties within a millisecond):
  ``audit_evicted_out``  an ``out`` to a client after its eviction committed
  (a ``preempt`` whose extra names it, or an ``evict`` of it, same queue and
  group) and before that client's next ``sub`` there (``resubscribed_at``:
  that sub's seq, null if none);
  ``audit_stale_epoch``  an ``out`` whose epoch is lower than the group's
  epoch set by an earlier ``seek`` (or ``sub``/``preempt``, which carry the
  group's epoch too: it never goes down);
  ``audit_double_ack``   a message acknowledged twice within a group with no
  rewind between (a ``seek``, or a ``preempt`` of a group whose on_preempt
  is ``earliest``: both legitimately deliver it again).
"""

from __future__ import annotations

from typing import Any

RESULT_TABLES = (
    "backlog", "backlog_by_topic", "priority_levels", "group_activity", "redeliveries", "delivery_counts", "consumers",
    "preemptions", "preemptions_by_group", "seeks", "events", "audit_coverage",
    "audit_evicted_out", "audit_stale_epoch", "audit_double_ack", "audit_marked_holding", "audit_stale_checkout",
)
# journal event -> small int code inside the job (0: any other event)
EVENT_CODES = {name: code for code, name in enumerate((
    "other", "out", "ack", "nack", "discard", "dead", "timeout", "preempt", "evict", "fenced", "seek", "sub", "leave",
    "purge", "replay"))}


def _names(queue):
    """(topic, lmq) from a queue id column, as fencemq.model.keys.queue_ref decodes it — no join.

    Ids are ``t:<topic>``, ``l:<topic>:<lmq>`` or ``f:<owner>:<filter>`` with ``%``, ``:``, braces and
    control bytes percent-escaped (so splitting on ':' is exact); a filter queue's topic is its filter.
    """
    from pyspark.sql import functions as F

    parts = F.split(queue, ":")

    escaped = F.instr(queue, "%") > 0

    def decode(part):  # url_decode would read '+' as a space: escape() leaves '+' as is
        return F.when(escaped, F.url_decode(F.regexp_replace(part, "\\+", "%2B"))).otherwise(part)

    kind = F.substring(queue, 1, 1)
    topic = F.when(kind == "f", decode(parts.getItem(2))).otherwise(decode(parts.getItem(1)))
    lmq = F.when(kind == "l", decode(parts.getItem(2)))
    return topic, lmq


def compute(tables: dict[str, Any], partitions: int, persisted: list[Any] | None = None, *,
            journal_bucketed: bool = False) -> dict[str, Any]:
    """Every result table as a (lazy) DataFrame.

    Every aggregation and join over the journal is per queue, so the journal
    is partitioned by queue once and Spark plans none of them with another
    exchange of it. A snapshot writes it bucketed by queue
    (``journal_bucketed``: a bucketed table, broker/ops/journal_buckets.py),
    so it is read that way and never shuffled; otherwise (an older snapshot,
    or a chain with one) it is shuffled ONCE: hash-partitioned by
    queue into ``partitions`` and sorted by (queue, group, seq) within each
    partition, then persisted. Every key starts with ``qk`` =
    xxhash64(queue) (queue ids share long prefixes, "l:topic:…", which would
    defeat the sorter's 8-byte key prefix); ``queue`` stays in every key, so
    a hash collision costs nothing. The audit joins each check's big side
    (outs, acks) once against the few events that matter (evictions, epoch
    raises, rewinds, ids acked more than once) instead of running windows
    over the whole journal. Frames persisted here are appended to
    ``persisted`` (unpersist them when done).
    """
    from pyspark import StorageLevel
    from pyspark.sql import functions as F

    col, when, count, lit = F.col, F.when, F.count, F.lit
    groups, members = tables["groups"], tables["members"]
    Q = ["qk", "queue"]  # the queue key
    QG = [*Q, "group"]

    def keep(df):
        df = df.persist(StorageLevel.MEMORY_AND_DISK)
        if persisted is not None:
            persisted.append(df)
        return df

    # Events are coded as small ints (cheaper to shuffle, cache and compare than strings);
    # events without a group (pub) take no part past the per-type counts.
    codes = F.create_map(*[x for name, code in EVENT_CODES.items() for x in (lit(name), lit(code))])
    raw = tables["journal"]
    is_out = col("event") == "out"
    j = (raw.where(col("group").isNotNull())
         .select(F.xxhash64("queue").alias("qk"), "queue", "group", "seq", "ms",
                 F.coalesce(codes[col("event")], lit(0)).cast("byte").alias("e"),
                 "member", "id", "tag", "epoch", when(~is_out, col("extra")).alias("extra"),
                 when(is_out, col("extra").cast("long")).alias("acq")))
    if not journal_bucketed:
        j = keep(j.repartition(partitions, "qk").sortWithinPartitions(*QG, "seq"))
    # (a bucketed journal is not cached: each use scans only the columns it needs from the buckets;
    # caching bought nothing at 1M lmqs, 89-92 Spark JVM CPU s either way, and would hold 100M rows at 10M)
    e = col("e")

    def is_(*events: str):
        return e.isin(*[EVENT_CODES[x] for x in events])

    def n(*events: str, extra=None):
        cond = is_(*events) if extra is None else is_(*events) & extra
        return count(when(cond, True))

    def named(df):  # topic and lmq of each queue first; the hash key dropped
        topic, lmq = _names(col("queue"))
        return df.select(topic.alias("topic"), lmq.alias("lmq"),
                         *[c for c in df.columns if c not in ("qk", "topic", "lmq")])

    out: dict[str, Any] = {}

    # -- backlog and oldest unacked age (the snapshot's groups table) -----------------------------
    backlog = groups.select(
        "topic", "lmq", "queue", "group", "mode", "owner", "members", "cursor", "epoch", "unread", "ready",
        "delayed", "checkouts", "backlog", "oldest_pending_id", "oldest_pending_ms",
        (col("snapshot_ms") - col("oldest_pending_ms")).alias("oldest_unacked_age_ms"), "unread_by_level")
    out["backlog"] = backlog
    out["backlog_by_topic"] = backlog.groupBy("topic", "group").agg(
        count(lit(1)).alias("queues"),
        count(when(col("backlog") > 0, True)).alias("queues_with_backlog"),
        F.sum("unread").alias("unread"), F.sum("ready").alias("ready"), F.sum("delayed").alias("delayed"),
        F.sum("checkouts").alias("checkouts"), F.sum("backlog").alias("backlog"),
        F.max("oldest_unacked_age_ms").alias("max_oldest_unacked_age_ms"))

    # -- a priority queue's levels: held per level (queues), each group's unread per level (groups) ------
    held = tables["queues"].where(col("held_by_level").isNotNull()).select(
        "topic", "queue", F.posexplode("held_by_level").alias("level", "held"))
    unread = groups.where(col("unread_by_level").isNotNull()).select(
        "queue", "group", F.posexplode("unread_by_level").alias("level", "unread"))
    out["priority_levels"] = (held.join(unread, ["queue", "level"], "left")
                              .where((col("held") > 0) | (F.coalesce(col("unread"), lit(0)) > 0))
                              .select("topic", "queue", col("level").cast("int").alias("level"), "group", "held",
                                      "unread"))

    # -- journal activity per group: one pass (distinct counts come from small side tables) -------
    churn = is_("preempt", "evict")
    activity = keep(j.groupBy(*QG).agg(
        n("out").alias("outs"), count(when(col("acq") > 1, True)).alias("redeliveries"),
        F.max("acq").alias("max_acquisitions"),
        n("ack").alias("acks"), n("nack").alias("nacks"), n("discard").alias("discards"),
        n("dead").alias("dead_letters"), n("timeout").alias("timeouts"), n("preempt").alias("preemptions"),
        n("evict").alias("evictions"), n("fenced").alias("fenced_pulls"), n("seek").alias("seeks"),
        n("sub").alias("subscribes"), n("leave").alias("leaves"), n("purge").alias("purges"),
        n("replay").alias("replays"),
        F.min(when(churn, col("ms"))).alias("first_preempt_ms"), F.max(when(churn, col("ms"))).alias("last_preempt_ms"),
        *[n("seek", extra=col("extra") == k).alias(f"seek_{k}") for k in ("earliest", "latest", "id", "time")],
        F.max(when(is_("seek"), col("ms"))).alias("last_seek_ms"),
        F.max(when(is_("seek"), col("epoch"))).alias("max_seek_epoch"),
        F.min("ms").alias("first_ms"), F.max("ms").alias("last_ms")))
    out["group_activity"] = named(activity.select(
        *QG, "outs", "redeliveries", "max_acquisitions", "acks", "nacks", "discards", "dead_letters",
        "timeouts", "preemptions", "evictions", "fenced_pulls", "seeks", "subscribes", "leaves", "purges",
        "replays", "first_ms", "last_ms"))

    outs = j.where(is_("out"))
    per_message = keep(outs.groupBy(*QG, "id").agg(F.max("acq").alias("deliveries")))
    messages = per_message.groupBy(*QG).agg(count(lit(1)).alias("messages"))
    out["redeliveries"] = named(activity.where(col("outs") > 0).join(messages, QG, "left").select(
        *QG, "outs", "redeliveries", "messages", "max_acquisitions"))

    who = j.where(churn).groupBy(*QG).agg(
        F.size(F.array_compact(F.array_distinct(F.flatten(F.collect_list(F.array(
            col("member"), when(is_("preempt"), col("extra")))))))).alias("owners"),
        F.countDistinct(when(is_("preempt"), col("extra")).otherwise(col("member"))).alias("evicted"))
    from_journal = (activity.where((col("preemptions") + col("evictions") + col("fenced_pulls")) > 0)
                    .join(who, QG, "left").select(
                        *Q, "group", col("preemptions").alias("j_p"), col("evictions").alias("j_e"),
                        col("fenced_pulls").alias("j_f"), F.coalesce("owners", lit(0)).alias("j_o"),
                        col("evicted").alias("j_evicted"), col("first_preempt_ms").alias("j_first"),
                        col("last_preempt_ms").alias("j_last")))
    # the counters in meta: every lmq has them, journal or not (lua/lib/lite.lua count_churn)
    from_meta = groups.where((col("preemptions") + col("evictions") + col("fenced_pulls")) > 0).select(
        F.xxhash64("queue").alias("qk"), "queue", "group", col("preemptions").alias("m_p"),
        col("evictions").alias("m_e"), col("fenced_pulls").alias("m_f"),
        F.size("churn_clients").alias("m_o"), col("churn_clients_capped").alias("m_capped"),
        col("first_churn_ms").alias("m_first"), col("last_churn_ms").alias("m_last"), "churn_clients")
    both = from_meta.join(from_journal, QG, "full")

    def larger(a: str, b: str):
        return F.greatest(F.coalesce(col(a), lit(0)), F.coalesce(col(b), lit(0)))

    out["preemptions"] = named(both.select(
        *QG, larger("m_p", "j_p").alias("preemptions"), larger("m_e", "j_e").alias("evictions"),
        larger("m_f", "j_f").alias("fenced_pulls"), larger("m_o", "j_o").alias("owners"),
        F.coalesce("m_capped", lit(False)).alias("owners_capped"),
        col("churn_clients").alias("clients"), F.coalesce("j_evicted", lit(0)).alias("evicted"),
        F.least("m_first", "j_first").alias("first_ms"), F.greatest("m_last", "j_last").alias("last_ms"),
        when(col("m_p").isNotNull() & col("j_p").isNotNull(), lit("meta+journal"))
        .when(col("m_p").isNotNull(), lit("meta")).otherwise(lit("journal")).alias("source")))
    out["preemptions_by_group"] = out["preemptions"].groupBy("topic", "group").agg(
        count(lit(1)).alias("queues"), F.sum("preemptions").alias("preemptions"),
        F.sum("evictions").alias("evictions"), F.sum("fenced_pulls").alias("fenced_pulls"))
    out["seeks"] = named(
        activity.where(col("seeks") > 0)
        .select(*QG, "seeks", *[col(f"seek_{k}").alias(k) for k in ("earliest", "latest", "id", "time")],
                "last_seek_ms", "max_seek_epoch")
        .join(groups.select("queue", "group", "epoch", "cursor"), ["queue", "group"], "left"))

    # -- delivery-count distribution ---------------------------------------------------------------
    by_event = outs.groupBy(col("acq").alias("acquisitions")).agg(count(lit(1)).alias("out_events"))
    by_message = per_message.groupBy(col("deliveries").alias("acquisitions")).agg(count(lit(1)).alias("messages"))
    out["delivery_counts"] = (by_event.join(by_message, "acquisitions", "full")
                              .select("acquisitions", F.coalesce("out_events", lit(0)).alias("out_events"),
                                      F.coalesce("messages", lit(0)).alias("messages")))

    # -- consumers: lock expiries and suspicions -------------------------------------------------
    QGM = [*QG, "member"]
    per_consumer = (j.where(is_("out", "ack", "nack", "discard", "timeout") & col("member").isNotNull())
                    .groupBy(*QGM).agg(
                        n("out").alias("outs"), n("ack").alias("acks"), n("nack", "discard").alias("nacks"),
                        n("timeout").alias("lock_expiries")))
    # one sweep call stamps every lease it expires with one ms: distinct ms = suspicions
    suspicions = (j.where(is_("timeout")).groupBy(*QGM, "ms").agg(count(lit(1)).alias("x"))
                  .groupBy(*QGM).agg(count(lit(1)).alias("suspicions")))
    now_state = members.select(F.xxhash64("queue").alias("qk"), "queue", "group", "member",
                               col("suspected").alias("suspected_now"), col("marker").alias("evicted_by"), "delivered")
    consumers = per_consumer.join(suspicions, QGM, "left").join(now_state, QGM, "full")
    zero = ["outs", "acks", "nacks", "lock_expiries", "suspicions"]
    out["consumers"] = named(consumers.select(
        *QGM, *[F.coalesce(c, lit(0)).alias(c) for c in zero],
        F.coalesce("suspected_now", lit(False)).alias("suspected_now"), "evicted_by", "delivered"))

    out["events"] = raw.groupBy("event").agg(count(lit(1)).alias("count"))

    # -- the fence audit, in journal order (seq), by joins against the few events that matter -------
    # (running windows over the whole journal cost a sort and a pass each; violations, evictions,
    # epoch raises and rewinds are rare, so each check joins the big side once against a small one)
    outs_ = outs.select(*QG, "seq", "ms", "member", "id", "tag", "epoch")

    # (a) a checkout handed to a client after its eviction committed, before it subscribed again:
    # each eviction opens a window [evicted_at, the client's next sub) in which no out may go to it
    evictions = j.where(churn).select(
        *QG, when(is_("preempt"), col("extra")).otherwise(col("member")).alias("member"),
        col("seq").alias("evicted_at"),
        when(is_("preempt"), col("member")).otherwise(col("extra")).alias("evicted_by"))
    subs = j.where(is_("sub")).select(*QG, "member", col("seq").alias("sub_at"))
    subs_of_evicted = subs.join(evictions.select(*QG, "member").distinct(), [*QG, "member"], "left_semi")
    fenced = (evictions.join(subs_of_evicted, [*QG, "member"], "left")
              .groupBy(*QG, "member", "evicted_at", "evicted_by")
              .agg(F.min(when(col("sub_at") > col("evicted_at"), col("sub_at"))).alias("until")))
    # the small side hashed, the big one streamed: no sort of every checkout (the journal's partitions
    # are the queue's buckets, so neither side moves)
    o, f = outs_.alias("o"), fenced.hint("shuffle_hash").alias("f")
    hits = o.join(f, [col(f"o.{k}") == col(f"f.{k}") for k in (*QG, "member")]
                  + [col("o.seq") > col("f.evicted_at"), col("f.until").isNull() | (col("o.seq") < col("f.until"))])
    out["audit_evicted_out"] = named(
        hits.groupBy(*[col(f"o.{c}") for c in (*QG, "member", "seq", "ms", "id", "tag", "epoch")])
        .agg(F.max("f.evicted_at").alias("evicted_at"),
             F.max_by("f.evicted_by", "f.evicted_at").alias("evicted_by"),
             F.max_by("f.until", "f.evicted_at").alias("resubscribed_at")))

    # (b) a checkout under a stale epoch: an earlier sub/seek/preempt of the group carried a higher
    # epoch (only epochs above 0 can be higher than an out's)
    raises = j.where(is_("seek", "sub", "preempt") & (col("epoch") > 0)).select(
        *QG, col("seq").alias("raised_at"), col("epoch").alias("raised_to"))
    o, r = outs_.alias("o"), raises.hint("shuffle_hash").alias("r")
    stale = o.join(r, [col(f"o.{k}") == col(f"r.{k}") for k in QG]
                   + [col("r.raised_at") < col("o.seq"), col("r.raised_to") > col("o.epoch")])
    out["audit_stale_epoch"] = named(
        stale.groupBy(*[col(f"o.{c}") for c in (*QG, "member", "seq", "ms", "id", "tag", "epoch")])
        .agg(F.max("r.raised_to").alias("group_epoch")))

    # (c) a message acknowledged twice within a group with no rewind between (a seek, or a preempt
    # of a group whose on_preempt is earliest: both deliver acked messages again). Ids acked once
    # (nearly all) are out at the first, cheap step.
    acks = j.where(is_("ack")).select(*QG, "id", "seq", "member", "tag")
    again = acks.groupBy(*QG, "id").agg(count(lit(1)).alias("n")).where(col("n") > 1)
    acks2 = acks.join(again.select(*QG, "id"), [*QG, "id"], "left_semi")
    rewinding = F.broadcast(groups.where(col("on_preempt") == "earliest").select("queue", "group"))
    rewinds = (j.where(is_("seek")).select(*QG, "seq")
               .unionByName(j.where(is_("preempt")).join(rewinding, ["queue", "group"], "left_semi")
                            .select(*QG, "seq"))
               .withColumnRenamed("seq", "rewind_at"))
    a, w = acks2.alias("a"), rewinds.alias("w")
    generations = (a.join(w, [col(f"a.{k}") == col(f"w.{k}") for k in QG] + [col("w.rewind_at") < col("a.seq")],
                          "left")
                   .groupBy(*[col(f"a.{c}") for c in (*QG, "id", "seq", "member", "tag")])
                   .agg(count("w.rewind_at").alias("generation")))
    doubles = (generations.groupBy(*QG, "id", "generation")
               .agg(count(lit(1)).alias("acks"), F.min("seq").alias("first_seq"), F.max("seq").alias("last_seq"),
                    F.sort_array(F.collect_list(F.struct("seq", "member", "tag"))).alias("by_seq"))
               .where(col("acks") > 1))
    out["audit_double_ack"] = named(doubles.select(
        *QG, "id", "acks", "first_seq", "last_seq", col("by_seq.member").alias("members"),
        col("by_seq.tag").alias("tags")))

    # -- state checks, on every queue (an lmq without a journal too): the snapshot's own rows --------
    checkouts = tables["checkouts"]
    marked = members.where(col("marker").isNotNull()).select("queue", "group", "member", "marker")
    out["audit_marked_holding"] = named(
        checkouts.join(marked, ["queue", "group", "member"])
        .select("queue", "group", "member", "marker", "tag", "id", "epoch", "deadline_ms"))
    out["audit_stale_checkout"] = named(
        checkouts.join(groups.select("queue", "group", col("epoch").alias("group_epoch")), ["queue", "group"])
        .where(col("epoch") < col("group_epoch"))
        .select("queue", "group", "member", "tag", "id", "epoch", "group_epoch"))

    queues = tables["queues"]
    per_queue_co = checkouts.groupBy("queue").agg(count(lit(1)).alias("n_co"))
    per_queue_mk = marked.groupBy("queue").agg(count(lit(1)).alias("n_mk"))
    out["audit_coverage"] = (
        queues.select("queue", "kind", (F.coalesce(col("journal_cap"), lit(0)) > 0).alias("journal"),
                      F.coalesce(col("journal_rows"), lit(0)).alias("rows"))
        .join(per_queue_co, "queue", "left").join(per_queue_mk, "queue", "left")
        .groupBy("kind", "journal").agg(
            count(lit(1)).alias("queues"), F.sum("rows").alias("journal_events"),
            F.sum(F.coalesce("n_co", lit(0))).alias("checkouts"),
            F.sum(F.coalesce("n_mk", lit(0))).alias("marked_members")))
    return out
