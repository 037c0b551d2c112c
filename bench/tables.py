#!/usr/bin/env python3
"""Prints the benchmark suite's results as the Markdown tables of docs/BENCHMARKS.md.

    tables.py RESULTS.json

Medians over the repetitions; ratios are strata's figure over the peer's (higher is better for
IOPS, so > 1.00x means strata is faster).
"""
import json
import statistics as st
import sys

res = json.load(open(sys.argv[1]))
SERVERS = ["strata", "strata-s3", "qemu-nbd", "nbdkit-cow", "nbdkit-memory", "raw"]


def med(rows, srv, sc, k):
    v = [r[k] for r in rows if r["server"] == srv and r["scenario"] == sc]
    return st.median(v) if v else None


runs = res.get("nbd") or []
if runs:
    reps = max(r["rep"] for r in runs)
    print(f"### 1. Protocol and data path ({reps} repetitions, medians)\n")
    servers = [s for s in SERVERS if any(r["server"] == s for r in runs)]
    scen = []
    for r in runs:
        if r["scenario"] not in scen and r["scenario"] != "fork-first-writes":
            scen.append(r["scenario"])
    print("| scenario | " + " | ".join(f"{s} IOPS" for s in servers)
          + " | ÷ qemu-nbd | ÷ nbdkit-cow | ÷ nbdkit-memory | ÷ raw |")
    print("|---|" + "---|" * (len(servers) + 4))
    for sc in scen:
        m = med(runs, "strata", sc, "iops")
        cells = [f"{med(runs, s, sc, 'iops') or 0:,.0f}" for s in servers]
        ratios = [f"{m / p:.2f}x" if (p := med(runs, s, sc, "iops")) else "-"
                  for s in ["qemu-nbd", "nbdkit-cow", "nbdkit-memory", "raw"]]
        print(f"| {sc} | " + " | ".join(cells) + " | " + " | ".join(ratios) + " |")
    print("\nLatency, p50 / p99 in µs (fio completion latency):\n")
    print("| scenario | " + " | ".join(servers) + " |")
    print("|---|" + "---|" * len(servers))
    for sc in scen:
        cells = [f"{med(runs, s, sc, 'p50_us') or 0:.0f} / {med(runs, s, sc, 'p99_us') or 0:.0f}"
                 for s in servers]
        print(f"| {sc} | " + " | ".join(cells) + " |")
    wa = [r for r in runs if r["scenario"] == "fork-first-writes"]
    if wa:
        g = wa[0]["guest_bytes"] >> 20
        print(f"\n### 2. First writes into a fresh fork ({g} MiB of random 4 KiB writes, each block once, QD1, then a flush)\n")
        print("| server | IOPS | p50 / p99 µs | host bytes written / guest bytes | of which local disk | strata IOPS ÷ this |")
        print("|---|---|---|---|---|---|")
        sm = med(wa, "strata", "fork-first-writes", "iops")
        for s in ["strata", "qemu-nbd", "nbdkit-cow"]:
            if not any(r["server"] == s for r in wa):
                continue
            i = med(wa, s, "fork-first-writes", "iops")
            print(f"| {s} | {i:,.0f} | {med(wa, s, 'fork-first-writes', 'p50_us'):.0f} / "
                  f"{med(wa, s, 'fork-first-writes', 'p99_us'):.0f} | "
                  f"{med(wa, s, 'fork-first-writes', 'write_amplification'):.2f} | "
                  f"{med(wa, s, 'fork-first-writes', 'local_write_amplification'):.2f} | {sm / i:.2f}x |")

cs = res.get("coldstart")
if cs:
    print(f"\n### 3. Cold start from S3 (moto + {cs['latency_ms']} ms per request; "
          f"{cs['tree_files']} files, {cs['tree_bytes'] >> 20} MiB of crate sources in ext4; "
          f"{cs.get('reps', 1)} fresh nodes, medians)\n")
    print("| measurement | value |")
    print("|---|---|")
    print(f"| create workspace from template | {cs['create_ms']:.0f} ms |")
    print(f"| attach (lease, manifest GET, journal, NBD export) | {cs['attach_ms']:.0f} ms |")
    print(f"| first 4 KiB read after attach (qemu-io, its start-up subtracted) | {cs['first_read_ms']:.0f} ms, {cs['first_read_gets']:.0f} GETs |")
    c, w = cs.get("cold"), cs.get("warm")
    if c:
        print(f"| find + grep -r, cold (empty node cache), read-ahead {cs.get('readahead_units', '-')} units | {c['ms'] / 1000:.2f} s |")
        if cs.get("cold_no_readahead"):
            print(f"| same, read-ahead off | {cs['cold_no_readahead']['ms'] / 1000:.2f} s |")
        print(f"| find + grep -r, warm (node cache; page cache dropped) | {w['ms'] / 1000:.2f} s |")
        print(f"| bytes the workload read from the disk | {c['bytes_read'] / 2**20:.1f} MiB ({c['four_kib_misses']:,.0f} × 4 KiB) |")
        print(f"| bytes fetched from the store | {c['bytes_fetched'] / 2**20:.1f} MiB ({c['fetched_over_read']:.2f}x read; goal ≤ 1.2x) |")
        print(f"| object GETs | {c['gets']:,.0f} (one per {c['bytes_fetched'] / max(1, c['gets']) / 2**10:.0f} KiB; {c['four_kib_misses'] / max(1, c['gets']):.0f}x fewer than 4 KiB misses) |")
    print(f"| daemon RSS idle / with {cs['attached']} attached workspaces | "
          f"{cs['daemon_rss_idle_kib'] / 1024:.0f} / {cs['daemon_rss_attached_kib'] / 1024:.0f} MiB "
          f"({cs['rss_per_workspace_kib']:.0f} KiB per workspace) |")

eng = res.get("engine") or {}
sc = eng.get("scaling")
if sc:
    print("\n### 4. Fork, checkpoint and restore scaling (engine, durable mode)\n")
    print("| logical disk | fork p50 | restore: attach / + first read, 0 ms store | same, 20 ms per request |")
    print("|---|---|---|---|")
    for f in sc["fork"]:
        r = {x["latency_ms"]: x for x in sc["restore"] if x["disk"] == f["disk"]}
        cells = [f"{r[l]['attach_ms']:.1f} / {r[l]['first_read_ms']:.1f} ms" if l in r else "-"
                 for l in (0, 20)]
        print(f"| {f['disk']} | {f['fork_p50_ms']:.2f} ms | {cells[0]} | {cells[1]} |")
    print("\n| dirty data (random 4 KiB, 64 GiB disk) | cut (writer lock held) | worst write during the checkpoint | p99 write during it | publish |")
    print("|---|---|---|---|---|")
    for c in sc["checkpoint"]:
        print(f"| {c['dirty_bytes'] >> 20} MiB | {c['cut_ms']:.2f} ms | {c['writer_worst_ms']:.2f} ms | "
              f"{c['writer_p99_ms'] * 1000:.0f} µs | {c['publish_ms']:.0f} ms |")
lv = eng.get("live_checkpoint")
if lv:
    print("\n### 7. Checkpoints of a live workspace (engine, durable mode, local receipts)\n")
    print("| dirty data (random writes, 16 GiB disk) | checkpoint p50 / p99 / max | concurrent writer worst / p99 | fork of the live workspace (waits for publication) |")
    print("|---|---|---|---|")
    for c in lv:
        print(f"| {c['dirty_bytes'] >> 20} MiB ({c['write_chunk'] >> 10} KiB writes) | {c['checkpoint_p50_ms']:.2f} / "
              f"{c['checkpoint_p99_ms']:.2f} / {c['checkpoint_max_ms']:.2f} ms | {c['writer_worst_ms']:.2f} / "
              f"{c['writer_p99_ms'] * 1000:.0f} µs | {c['fork_of_live_ms']:.0f} ms |")
    print(f"\nRatio of checkpoint p99, {lv[-1]['dirty_bytes'] >> 20} MiB dirty ÷ none: "
          f"{lv[-1]['checkpoint_p99_ms'] / max(lv[0]['checkpoint_p99_ms'], 1e-9):.2f} (goal ≤ 1.5; p99 goal ≤ 5 ms).")
sh = eng.get("shared_cache")
if sh:
    print(f"\n### 5. Shared cache\n\n8 forks of one {sh['data_bytes'] >> 20} MiB base cold-reading it at once on one "
          f"node: {sh['eight_forks_gets']} GETs ({sh['eight_forks_bytes'] >> 20} MiB) against "
          f"{sh['one_reader_gets']} GETs ({sh['one_reader_bytes'] >> 20} MiB) for one reader: "
          f"**{sh['ratio']:.2f}x** (goal ≤ 1.1x).")
mem = eng.get("memory")
if mem:
    print(f"\n### 6. Memory\n\nHeap bytes held (a counting allocator), {mem['runs']:,} runs/extents: "
          f"**{mem['manifest_bytes_per_extent']:.1f} B per base-manifest extent** (goal ≤ 32 B), "
          f"{mem['overlay_bytes_per_run']:.1f} B per overlay run (writes since the last checkpoint); "
          f"heap peak during the publish of {mem['data_bytes'] >> 20} MiB: "
          f"{mem['publish_peak_bytes'] >> 20} MiB above the start.")
sp = res.get("space")
if sp:
    live = sp[0]["live_bytes"] >> 20
    print(f"\n### 8. Local disk use of the embedded default ({live} MiB live)\n")
    print("| phase | journal MiB (of which spares) | objects MiB | catalog MiB | (total − spares) ÷ live |")
    print("|---|---|---|---|---|")
    for r in sp:
        print(f"| {r['phase']} | {r['journal_bytes'] >> 20} ({r['spare_bytes'] >> 20}) | "
              f"{r['object_bytes'] >> 20} | {r['catalog_bytes'] / 2**20:.1f} | "
              f"{r['ratio_without_spares']:.2f}x (goal ≤ 1.2x) |")
