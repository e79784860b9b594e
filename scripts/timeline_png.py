#!/usr/bin/env python3
"""Renders a merged DTRAIN_TIMELINE trace as a PNG with gnuplot: one row
per (rank, track), one bar per span, a window of STEPS training steps taken
from the middle of the run (by rank 0's "forward" spans).

    scripts/timeline_png.py TRACE.json OUT.png [STEPS]
"""
import json
import subprocess
import sys
import tempfile

COLORS = {"forward": "#4e79a7", "backward": "#f28e2b", "optimizer.step": "#59a14f",
          "wait for buckets": "#e15759", "bucket": "#b07aa1", "collective": "#9c755f"}


def category(name, tid):
    if name.startswith("bucket "):
        return "bucket"
    if tid >= 1000:
        return "collective"
    return name if name in COLORS else "forward"


def main():
    trace, out = sys.argv[1], sys.argv[2]
    steps = int(sys.argv[3]) if len(sys.argv) > 3 else 3
    events = json.load(open(trace))["traceEvents"]
    names = {(e["pid"], e.get("tid")): e["args"]["name"] for e in events
             if e["ph"] == "M" and e["name"] == "thread_name"}
    spans = [e for e in events if e["ph"] == "X"]
    starts = sorted(e["ts"] for e in spans if e["pid"] == 0 and e["name"] == "forward")
    if len(starts) < steps + 1:
        sys.exit("timeline_png: fewer than %d steps in %s" % (steps + 1, trace))
    mid = len(starts) // 2
    t0, t1 = starts[mid], starts[min(mid + steps, len(starts) - 1)]
    rows = sorted({(e["pid"], e["tid"]) for e in spans})
    row_of = {r: i for i, r in enumerate(reversed(rows))}
    with tempfile.NamedTemporaryFile("w", suffix=".dat", delete=False) as data:
        for e in spans:
            b, end = e["ts"], e["ts"] + e["dur"]
            if end < t0 or b > t1:
                continue
            b, end = max(b, t0), min(end, t1)
            y = row_of[(e["pid"], e["tid"])]
            color = int(COLORS[category(e["name"], e["tid"])][1:], 16)
            # x: the span's centre (ms from the window's start), y: its row,
            # half its width, its colour
            data.write("%f %d %f %d\n" % ((b + end) / 2000.0 - t0 / 1000.0, y,
                                           (end - b) / 2000.0, color))
    labels = ", ".join('"rank %d %s" %d' % (p, names.get((p, t), "track %d" % t), row_of[(p, t)])
                       for p, t in rows)
    keys = "; ".join('set object %d rect from screen 0.875, screen %f to screen 0.89, screen %f '
                     'fc rgb "%s" fs solid noborder; set label %d "%s" at screen 0.895, screen %f '
                     'left font ",9" noenhanced' % (i + 1, 0.86 - i * 0.07, 0.9 - i * 0.07, c,
                                                    i + 1, k, 0.88 - i * 0.07)
                     for i, (k, c) in enumerate(COLORS.items()))
    script = """
set terminal pngcairo size 1400,%d font "Liberation Sans,10"
set output "%s"
set title "dtrain timeline: %d steps of 2-rank DDP (DTRAIN_TIMELINE, merged by dtrain-run)" noenhanced
set xlabel "ms"
set ytics (%s) noenhanced
set yrange [-0.7:%f]
set rmargin at screen 0.86
unset key
%s
plot "%s" using 1:2:3:(0.35):4 with boxxyerror fs solid 0.9 noborder lc rgb variable
""" % (160 + 28 * len(rows), out, steps, labels, len(rows) - 0.3, keys, data.name)
    subprocess.run(["gnuplot"], input=script, text=True, check=True)


if __name__ == "__main__":
    main()
