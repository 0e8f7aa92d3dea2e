"""What bench/hostile.py's numbers mean: the accounting that turns its processes' records into
delivered, lost and crashed, and the request latencies under attack into ratios. Here, not in
bench/, because tests check it (tests/ops/test_bench_hostile.py) and tests never import bench/.
"""

from __future__ import annotations

ATTACK_UNITS = {
    "invalid": "gossip frames",
    "invalid_noban": "gossip frames",
    "replay": "gossip frames",
    "useless": "gossip frames",
    "connections": "libp2p connections (attempted / established)",
    "chunks": "data-plane connections (attempted / accepted with 4 GETs each)",
    "unserved": "batch announcements",
    "garbage": "garbage batches (announced and served)",
    "slowstreams": "request streams opened and held unfinished",
}


def pct(xs: list[float], q: float):
    if not xs:
        return None
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, int(q * len(xs)))], 1)


def summarise_requests(requests: dict[str, dict[str, list[float | None]]]) -> dict:
    """``slowstreams``: honest genesis / peer-exchange latency per window, failures, ratios."""
    out: dict = {}
    for window, kinds in requests.items():
        for kind, vals in kinds.items():
            ok = [v for v in vals if v is not None]
            out.setdefault(kind, {})[window] = {
                "asked": len(vals),
                "failed": len(vals) - len(ok),
                "p50_ms": pct(ok, 0.5),
                "p99_ms": pct(ok, 0.99),
                "max_ms": pct(ok, 1.0),
            }
    notes = []
    for kind, w in out.items():
        q, at = w.get("quiet", {}), w.get("attack", {})
        for k in ("p50", "p99"):
            qv, av = q.get(f"{k}_ms"), at.get(f"{k}_ms")
            w[f"{k}_over_quiet"] = round(av / qv, 2) if qv and av is not None else None
        notes.append(
            f"{kind} p50 {q.get('p50_ms')}>{at.get('p50_ms')} ms, p99 {q.get('p99_ms')}>{at.get('p99_ms')} ms "
            f"({w['p99_over_quiet']}x), failed {q.get('failed')}/{q.get('asked')} > {at.get('failed')}/{at.get('asked')}"
        )
    out["note"] = "; ".join(notes)
    return out


def summarise(args, scen, results, stats, final, probe_fail_attack, probe_rtts, dead) -> dict:
    sent = next(r["sent"] for r in results if r["shard"] == 0)
    arrivals = {int(i): rec for r in results for i, rec in r["arrivals"].items()}
    fetched = {int(i): rec for r in results for i, rec in r["fetched"].items()}
    receivers = [i for i in range(args.honest) if i != 0]
    out: dict = {}
    # ---- honest gossip: delivery and latency per window; data lost
    lost_msgs, lost_pairs = 0, 0
    for phase, key in (("quiet", "quiet"), ("attack", "attack_window")):
        ids = [b for b, (_t, ph) in sent.items() if ph == phase]
        lat, got = [], 0
        for b in ids:
            t0 = sent[b][0]
            missing = 0
            for i in receivers:
                t = arrivals.get(i, {}).get(b)
                if t is None:
                    missing += 1
                else:
                    got += 1
                    lat.append((t - t0) * 1000)
            lost_msgs += missing > 0
            lost_pairs += missing
        expected = len(ids) * len(receivers)
        out[key] = {
            "sent": len(ids),
            "delivery": round(got / expected, 4) if expected else None,
            "p50_ms": pct(lat, 0.50),
            "p99_ms": pct(lat, 0.99),
            "max_ms": pct(lat, 1.0),
        }
    q99, a99 = out["quiet"]["p99_ms"], out["attack_window"]["p99_ms"]
    out["delivery"] = out["attack_window"]["delivery"]
    out["p99_over_quiet"] = round(a99 / q99, 2) if q99 and a99 is not None else None
    lost = {"messages": lost_msgs, "message_receiver_pairs": lost_pairs}
    notes = []
    # ---- unserved: honest batches each fetcher fetched
    if scen == "unserved":
        per, lat, unfetched = {}, [], 0
        for i in range(1, min(args.fetchers, args.honest - 1) + 1):
            rec = fetched.get(i, {})  # a fetcher whose process died fetched nothing we know of
            ids = [b for b, (_t, ph) in sent.items() if ph in ("quiet", "attack")]
            miss = [b for b in ids if b not in rec]
            unfetched += len(miss)
            att = [b for b, (_t, ph) in sent.items() if ph == "attack"]
            lat += [(rec[b] - sent[b][0]) * 1000 for b in att if b in rec]
            per[i] = {
                "fetched_attack": round(sum(1 for b in att if b in rec) / len(att), 4) if att else None,
                "missing": len(miss),
            }
        qlat = [
            (rec[b] - t0) * 1000
            for rec in fetched.values()
            for b, (t0, ph) in sent.items()
            if ph == "quiet" and b in rec
        ]
        out["batches"] = {
            "per_fetcher": per,
            "fetch_p50_ms": pct(lat, 0.5),
            "fetch_p99_ms": pct(lat, 0.99),
            "quiet_fetch_p99_ms": pct(qlat, 0.99),
        }
        lost["batches_never_fetched"] = unfetched
        out["memory_note"] = (
            f"nodes 1-{args.fetchers} (fetchers) import node.roles.validator, hence torch "
            "(~190 MiB more RSS from the start); compare growth, not level"
        )
        ratios = [v["fetched_attack"] for v in per.values() if v["fetched_attack"] is not None]
        notes.append(f"batches fetched {min(ratios):.0%}" if ratios else "no fetcher")
        if lat:
            notes.append(f"fetch p99 {pct(lat, 0.99):.0f} ms (quiet {pct(qlat, 0.99) or 0:.0f})")
    # ---- garbage: honest batch verification latency (announce -> vote), what the flood cost
    if scen == "garbage":
        voted = {b: v for r in results for b, v in r.get("voted", {}).items()}
        windows = {}
        for phase in ("quiet", "attack"):
            ids = [b for b, (_t, ph) in sent.items() if ph == phase]
            lat = [(voted[b][0] - sent[b][0]) * 1000 for b in ids if b in voted]
            # where the time went: announce -> queued (gossip, fetch, model-free rules), queued ->
            # verification start (the verify queue), the verification itself
            staged = [(sent[b][0], *voted[b]) for b in ids if b in voted and len(voted[b]) >= 5 and voted[b][3]]
            windows[phase] = {
                "batches": len(ids),
                "voted": sum(1 for b in ids if b in voted),
                "accepted": sum(1 for b in ids if b in voted and voted[b][1]),
                "p50_ms": pct(lat, 0.5),
                "p99_ms": pct(lat, 0.99),
                "max_ms": pct(lat, 1.0),
                "fetch_p50_ms": pct([(q - t0) * 1000 for t0, _v, _a, _r, q, _s in staged], 0.5),
                "queue_p50_ms": pct([(v - s - q) * 1000 for _t0, v, _a, _r, q, s in staged], 0.5),
                "verify_p50_ms": pct([s * 1000 for *_, s in staged], 0.5),
            }
        vq, va = windows["quiet"], windows["attack"]

        def over(k: str):
            return round(va[k] / vq[k], 2) if vq[k] and va[k] is not None else None

        counted = [b for b, (_t, ph) in sent.items() if ph in ("quiet", "attack")]
        lost["batches_never_voted"] = sum(1 for b in counted if b not in voted)
        lost["honest_batches_rejected"] = sum(1 for b in counted if b in voted and not voted[b][1])
        rejected_rules = sorted({rule for b in counted if b in voted and not voted[b][1] for rule in [voted[b][2]]})
        val = {}
        for r in results:
            for i in r["nodes"]:
                if "validator" in r["after"][str(i)]:
                    b, a = r["before"][str(i)]["validator"], r["after"][str(i)]["validator"]

                    def delta(key: str, b=b, a=a) -> dict:
                        return {k: v - b[key].get(k, 0) for k, v in a[key].items() if v - b[key].get(k, 0)}

                    qd = {
                        k: v - b["verify_queue"]["dropped"].get(k, 0) for k, v in a["verify_queue"]["dropped"].items()
                    }
                    val = {
                        "rejected_by_rule": delta("reasons"),
                        "verdicts": delta("verdicts"),
                        "verify_queue_dropped": {k: v for k, v in qd.items() if v},
                        "verify_queue_at_end": a["verify_queue"],
                        "banned_at_end": a["banned"],
                        "last_verify_s": a["last_verify_s"],
                    }
        prefilled = sum(v for k, v in val.get("rejected_by_rule", {}).items() if k in ("toploc", "proof", "sampling"))
        dropped_q = sum(val.get("verify_queue_dropped", {}).values())
        out["verification"] = {
            "quiet": vq,
            "attack_window": va,
            "p50_over_quiet": over("p50_ms"),
            "p99_over_quiet": over("p99_ms"),
            "honest_rejected_rules": rejected_rules,
            "garbage_prefilled": prefilled,
            "garbage_dropped_from_verify_queue": dropped_q,
            "validator": val,
        }
        out["verification"]["verify_queue"] = getattr(args, "verify_queue", "fair")
        notes.append(
            ("first-come verify channel (baseline): " if out["verification"]["verify_queue"] == "fifo" else "")
            + f"honest verify p50 {vq['p50_ms']}>{va['p50_ms']} ms ({over('p50_ms')}x), "
            f"p99 {vq['p99_ms']}>{va['p99_ms']} ms ({over('p99_ms')}x), {va['voted']}/{va['batches']} voted "
            f"(p50 fetch/queue/verify {vq['fetch_p50_ms']}/{vq['queue_p50_ms']}/{vq['verify_p50_ms']} > "
            f"{va['fetch_p50_ms']}/{va['queue_p50_ms']}/{va['verify_p50_ms']} ms); "
            f"garbage: {prefilled} prefilled, {dropped_q} dropped from the verify queue"
        )
    # ---- chunks: v1 at every node
    if scen == "chunks":
        ck = {int(i): v for r in results for i, v in r["ckpt"].items()}
        pub = next((r["v1_published"] for r in results if r["shard"] == 0), None)
        times = [v["done_at"] - pub for v in ck.values() if v["done_at"] and pub]
        incomplete = [i for i in range(args.honest) if not ck.get(i, {}).get("holds_v1")]
        out["checkpoint"] = {
            "nodes_with_v1": args.honest - len(incomplete),
            "incomplete": incomplete,
            "chunks_missing": sum(max(0, ck[i]["missing_chunks"]) for i in incomplete if i in ck),
            "seconds_to_v1_max": round(max(times), 2) if times else None,
            "seconds_to_v1_median": round(sorted(times)[len(times) // 2], 2) if times else None,
            "per_node": ck,
        }
        lost["nodes_without_v1"] = len(incomplete)
        lost["v1_chunks_missing"] = out["checkpoint"]["chunks_missing"]
        notes.append(
            f"v1 on {args.honest - len(incomplete)}/{args.honest} nodes"
            + (f", slowest {max(times):.1f} s" if times else "")
        )
    out["data_lost"] = (
        lost_msgs
        + lost.get("batches_never_fetched", 0)
        + lost.get("nodes_without_v1", 0)
        + lost.get("batches_never_voted", 0)
        + lost.get("honest_batches_rejected", 0)
    )
    out["data_lost_detail"] = lost
    # ---- counters: bad inputs dropped by the honest side, internal failures, tables
    dropped_by: dict[str, int] = {}
    internal, bans = 0, 0
    tables: dict[str, int] = {}

    def add(k, v):
        if v:
            dropped_by[k] = dropped_by.get(k, 0) + v

    for r in results:
        for i in r["nodes"]:
            b, a = r["before"][str(i)], r["after"][str(i)]
            for reason, v in a["dropped"].items():
                add(f"gossip:{reason}", v - b["dropped"].get(reason, 0))
            add("accept_refused", a["inbound_refused"] - b["inbound_refused"])
            add("connections_trimmed", a["trimmed"] - b["trimmed"])
            add("connections_without_gossip_closed", a["dropped_no_gossip"] - b["dropped_no_gossip"])
            if "fetcher" in a:
                add("announces_shed", a["fetcher"]["dropped_announces"] - b["fetcher"]["dropped_announces"])
                for code, v in a["fetcher"].get("failures_by_code", {}).items():
                    add(f"fetches_failed:{code}", v - b["fetcher"].get("failures_by_code", {}).get(code, 0))
            if "dataplane" in a:
                add("dataplane_refused_full", a["dataplane"]["refused_full"] - b["dataplane"]["refused_full"])
            if "validator" in a:
                for rule, v in a["validator"]["reasons"].items():
                    add(f"batches_rejected:{rule}", v - b["validator"]["reasons"].get(rule, 0))
                qa, qb = a["validator"]["verify_queue"]["dropped"], b["validator"]["verify_queue"]["dropped"]
                for reason, v in qa.items():
                    add(f"verify_queue_dropped:{reason}", v - qb.get(reason, 0))
                add("announces_shed", a["validator"]["dropped_announces"] - b["validator"]["dropped_announces"])
            internal += a["internal"]
            bans += a["bans"]
            for k, v in a["tables"].items():
                tables[k] = max(tables.get(k, 0), v)
    out["bad_inputs_dropped"] = sum(dropped_by.values())
    out["dropped_by"] = dict(sorted(dropped_by.items(), key=lambda kv: -kv[1]))
    out["bans"] = bans
    out["tables_max"] = tables
    # ---- memory: per process (= per node with one node per process)
    mem = {}
    for r in results:
        mem[f"proc{r['shard']}"] = {
            "nodes": r["nodes"],
            "rss_before_mib": r["rss_before_mib"],
            "peak_mib": r["rss_peak_mib"],
            "hwm_mib": r["hwm_mib"],
        }
    out["memory"] = mem
    out["peak_rss_mib_max"] = max(v["peak_mib"] for v in mem.values())
    out["rss_growth_mib_max"] = round(max(v["peak_mib"] - v["rss_before_mib"] for v in mem.values()), 1)
    out["nodes_per_process"] = max(len(v["nodes"]) for v in mem.values())
    # ---- crashes
    unresponsive = sorted(i for i, v in final.items() if v is None)
    exceptions = sum(r["exceptions"] for r in results)
    out["crashed_nodes"] = sorted(set(unresponsive) | set(dead))
    out["internal_failures"] = internal
    out["exceptions_logged"] = exceptions
    out["exception_samples"] = [s for r in results for s in r["exception_samples"]][:5]
    out["crashes"] = len(out["crashed_nodes"]) + internal + exceptions
    out["probe"] = {
        "failed_during_attack": probe_fail_attack,
        "rtt_p99_ms_during_attack": pct(probe_rtts, 0.99),
        "final_ms": {i: (round(v, 1) if v is not None else None) for i, v in sorted(final.items())},
    }
    # ---- the attack
    if stats is not None:
        secs = stats.get("seconds") or 1
        offered = stats.get("offered", stats.get("written", 0))
        out["attack"] = {
            **stats,
            "offered_per_s": round(offered / secs, 1),
            "written_per_s": round(stats.get("written", 0) / secs, 1),
        }
        out["bad_inputs_tried"] = stats.get("written", 0)
        out["identities"] = stats.get("identities")
    else:
        out["attack"] = None
        out["bad_inputs_tried"] = 0
        out["identities"] = 0
    out["attack_unit"] = ATTACK_UNITS.get(scen)
    out["notes"] = "; ".join(notes)
    return out
