#!/usr/bin/env python3
"""Draws the benchmark suite's results as SVG bar charts (standard library only).

    plot.py RESULTS.json OUT_DIR

RESULTS.json is what bench/run.sh writes. Every chart shows medians over the repetitions.
"""
import json
import math
import os
import statistics as st
import sys
from html import escape

COLORS = {"strata": "#1f6feb", "strata-s3": "#7c3aed", "qemu-nbd": "#d97706", "nbdkit-cow": "#059669",
          "nbdkit-memory": "#9ca3af", "raw": "#6b7280"}
PALETTE = ["#1f6feb", "#d97706", "#059669", "#9ca3af", "#6b7280", "#b91c1c"]


def fmt(v):
    if v == 0:
        return "0"
    if abs(v) >= 100:
        return f"{v:,.0f}"
    if abs(v) >= 10:
        return f"{v:.1f}"
    return f"{v:.2f}"


def bars(path, title, groups, series, value, unit="", log=False, ref=None, ref_label="",
         note=""):
    """Grouped vertical bars: one group per entry of `groups`, one bar per series;
    value(group, series) -> float or None."""
    gw = max(60, 22 * len(series) + 24)
    left, top, bottom = 70, 48, 86
    width = left + gw * len(groups) + 180
    height = 360
    ph = height - top - bottom
    vals = [value(g, s) for g in groups for s in series]
    vals = [v for v in vals if v is not None and v > 0] or [1]
    hi = max(vals + ([ref] if ref else []))
    if log:
        lo = min(vals + ([ref] if ref else []))
        lo_e, hi_e = math.floor(math.log10(lo)), math.ceil(math.log10(hi))
        if hi_e == lo_e:
            hi_e += 1

        def y(v):
            v = max(v, 10 ** lo_e)
            return top + ph - ph * (math.log10(v) - lo_e) / (hi_e - lo_e)
        ticks = [10 ** e for e in range(lo_e, hi_e + 1)]
    else:
        base = 10 ** math.floor(math.log10(hi))
        step = next(base * m for m in (0.1, 0.2, 0.5, 1, 2, 5) if hi / (base * m) <= 6)
        top_v = step * math.ceil(hi / step)

        def y(v):
            return top + ph - ph * v / top_v
        ticks = [step * i for i in range(int(round(top_v / step)) + 1)]
    o = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
         f'font-family="sans-serif" font-size="11">',
         f'<rect width="{width}" height="{height}" fill="white"/>',
         f'<text x="{left}" y="20" font-size="14" font-weight="bold">{escape(title)}</text>']
    if note:
        o.append(f'<text x="{left}" y="36" fill="#555">{escape(note)}</text>')
    for t in ticks:
        ty = y(t)
        o.append(f'<line x1="{left}" x2="{left + gw * len(groups)}" y1="{ty:.1f}" y2="{ty:.1f}" stroke="#eee"/>')
        o.append(f'<text x="{left - 6}" y="{ty + 4:.1f}" text-anchor="end">{fmt(t)}</text>')
    o.append(f'<text x="14" y="{top + ph / 2}" transform="rotate(-90 14 {top + ph / 2})" '
             f'text-anchor="middle">{escape(unit)}{" (log)" if log else ""}</text>')
    bw = (gw - 24) / max(1, len(series))
    for gi, g in enumerate(groups):
        gx = left + gi * gw + 12
        for si, s in enumerate(series):
            v = value(g, s)
            if v is None:
                continue
            x = gx + si * bw
            yy = y(v) if v > 0 else top + ph
            c = COLORS.get(s, PALETTE[si % len(PALETTE)])
            o.append(f'<rect x="{x:.1f}" y="{yy:.1f}" width="{bw - 2:.1f}" height="{top + ph - yy:.1f}" fill="{c}">'
                     f'<title>{escape(str(s))} {escape(str(g))}: {fmt(v)} {escape(unit)}</title></rect>')
            if len(series) <= 3:
                o.append(f'<text x="{x + bw / 2:.1f}" y="{yy - 3:.1f}" text-anchor="middle" font-size="9">{fmt(v)}</text>')
        lx = gx + (gw - 24) / 2
        o.append(f'<text x="{lx:.1f}" y="{top + ph + 14}" text-anchor="end" '
                 f'transform="rotate(-30 {lx:.1f} {top + ph + 14})">{escape(str(g))}</text>')
    o.append(f'<line x1="{left}" x2="{left + gw * len(groups)}" y1="{top + ph}" y2="{top + ph}" stroke="#333"/>')
    if ref:
        ry = y(ref)
        o.append(f'<line x1="{left}" x2="{left + gw * len(groups)}" y1="{ry:.1f}" y2="{ry:.1f}" '
                 f'stroke="#b91c1c" stroke-dasharray="5,3"/>')
        o.append(f'<text x="{left + gw * len(groups) + 4}" y="{ry + 4:.1f}" fill="#b91c1c">{escape(ref_label)}</text>')
    lx = left + gw * len(groups) + 20
    for si, s in enumerate(series):
        c = COLORS.get(s, PALETTE[si % len(PALETTE)])
        ly = top + 20 + si * 18
        o.append(f'<rect x="{lx}" y="{ly - 9}" width="10" height="10" fill="{c}"/>')
        o.append(f'<text x="{lx + 14}" y="{ly}">{escape(str(s))}</text>')
    o.append("</svg>")
    with open(path, "w") as f:
        f.write("\n".join(o) + "\n")
    print(path)


def main():
    res = json.load(open(sys.argv[1]))
    out = sys.argv[2]
    os.makedirs(out, exist_ok=True)
    runs = res.get("nbd") or []
    servers = [s for s in ["strata", "strata-s3", "qemu-nbd", "nbdkit-cow", "nbdkit-memory", "raw"]
               if any(r["server"] == s for r in runs)]
    scen = []
    for r in runs:
        if r["scenario"] not in scen and r["scenario"] != "fork-first-writes":
            scen.append(r["scenario"])

    def med(srv, sc, k):
        v = [r[k] for r in runs if r["server"] == srv and r["scenario"] == sc]
        return st.median(v) if v else None

    if scen:
        bars(f"{out}/nbd-ratio.svg", "NBD data path: IOPS relative to qemu-nbd (qcow2 overlay)",
             scen, servers, lambda g, s: (med(s, g, "iops") or 0) / (med("qemu-nbd", g, "iops") or 1),
             unit="× qemu-nbd IOPS", log=True, ref=1.0, ref_label="qemu-nbd",
             note="fio over the NBD unix socket (raw: fio on the file); higher is better")
        bars(f"{out}/nbd-latency.svg", "NBD data path: p99 completion latency",
             scen, servers, lambda g, s: med(s, g, "p99_us"), unit="µs", log=True,
             note="lower is better")
    wa = [r for r in runs if r["scenario"] == "fork-first-writes"]
    if wa:
        peers = [s for s in ["strata", "qemu-nbd", "nbdkit-cow"] if any(r["server"] == s for r in wa)]
        bars(f"{out}/fork-writes.svg", "First 4 KiB writes into a fresh fork",
             ["write amplification", "local write amplification"], peers,
             lambda g, s: med(s, "fork-first-writes", "write_amplification" if g.startswith("write") else "local_write_amplification"),
             unit="host bytes / guest bytes", ref=1.0, ref_label="1.0",
             note="bytes the server sent to storage per byte written; lower is better")
        bars(f"{out}/fork-writes-iops.svg", "First 4 KiB writes into a fresh fork: IOPS (QD1)",
             ["IOPS"], peers, lambda g, s: med(s, "fork-first-writes", "iops"), unit="IOPS")
    eng = res.get("engine") or {}
    sc = eng.get("scaling") or {}
    if sc.get("fork"):
        disks = [f["disk"] for f in sc["fork"]]
        bars(f"{out}/fork-scaling.svg", "Fork time against logical disk size",
             disks, ["fork p50"], lambda g, s: next(f["fork_p50_ms"] for f in sc["fork"] if f["disk"] == g),
             unit="ms", ref=5.0, ref_label="goal 5 ms")
    if sc.get("restore"):
        disks = [f["disk"] for f in sc["fork"]]
        lats = sorted({r["latency_ms"] for r in sc["restore"]})

        def rv(g, s):
            lat, k = s.split(" ms ", 1)
            key = "attach_ms" if k == "attach" else "first_read_ms"
            return next((r[key] for r in sc["restore"] if r["disk"] == g and r["latency_ms"] == int(lat)), None)
        bars(f"{out}/restore.svg", "Restore on a fresh node: attach, and attach + first read",
             disks, [f"{l} ms attach" for l in lats] + [f"{l} ms first read" for l in lats], rv,
             unit="ms", ref=100.0, ref_label="goal 100 ms",
             note="series: store latency per request; empty node cache")
    if sc.get("checkpoint"):
        cps = sc["checkpoint"]
        names = [f"{c['dirty_bytes'] >> 20} MiB" for c in cps]
        keys = {"cut (writer lock)": "cut_ms", "worst concurrent write": "writer_worst_ms",
                "publish": "publish_ms"}
        bars(f"{out}/checkpoint.svg", "Checkpoint against dirty data (64 GiB disk)", names, list(keys),
             lambda g, s: max(1e-3, next(c[keys[s]] for c in cps if f"{c['dirty_bytes'] >> 20} MiB" == g)),
             unit="ms", log=True, ref=10.0, ref_label="stall goal 10 ms")
    cs = res.get("coldstart") or {}
    if cs.get("cold"):
        c, w = cs["cold"], cs["warm"]
        bars(f"{out}/coldstart-bytes.svg",
             f"Cold start from S3 ({cs['latency_ms']} ms per request): find + grep -r over {cs['tree_files']} files",
             ["MiB read by the workload", "MiB fetched from the store"], ["cold"],
             lambda g, s: (c["bytes_read"] if "read" in g else c["bytes_fetched"]) / 2**20, unit="MiB",
             note="goal: fetched ≤ 1.2 × read")
        bars(f"{out}/coldstart-requests.svg", "Cold start: store GETs against 4 KiB misses",
             ["4 KiB misses (no coalescing)", "object GETs"], ["cold"],
             lambda g, s: c["four_kib_misses"] if "misses" in g else c["gets"], unit="requests", log=True)
        times = {"cold, read-ahead off": cs.get("cold_no_readahead"), "cold": c, "warm": w}
        times = {k: v for k, v in times.items() if v}
        bars(f"{out}/coldstart-time.svg", "Cold start: workload time, cold (S3) and warm (node cache)",
             ["find + grep -r"], list(times), lambda g, s: times[s]["ms"] / 1000, unit="s")
    mem = eng.get("memory") or {}
    if mem:
        bars(f"{out}/memory.svg", "Memory per extent (heap bytes held)",
             ["base manifest extent", "overlay run (since last checkpoint)"], ["bytes"],
             lambda g, s: mem["manifest_bytes_per_extent"] if g.startswith("base") else mem["overlay_bytes_per_run"],
             unit="bytes", ref=32.0, ref_label="goal 32 B")


main()
