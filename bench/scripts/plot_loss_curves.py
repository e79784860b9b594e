#!/usr/bin/env python3
"""Draws the loss curves of `dtrain-bench slow-links --csv CSV` as an SVG.

Usage: plot_loss_curves.py CSV SVG [TITLE]

The CSV has a header "step,samples,<name>,<name>..." and one row per
evaluation; every column after `samples` becomes one line against samples.
Plain SVG, no plotting library needed.
"""
import csv
import sys

WIDTH, HEIGHT = 640, 400
LEFT, RIGHT, TOP, BOTTOM = 64, 150, 40, 48
COLOURS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e"]


def read(path):
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    if len(rows) < 2 or rows[0][:2] != ["step", "samples"]:
        sys.exit(f"{path}: not a slow-links curve (expected a 'step,samples,...' header and rows)")
    names = rows[0][2:]
    samples = [float(r[1]) for r in rows[1:]]
    series = {n: [float(r[2 + i]) for r in rows[1:]] for i, n in enumerate(names)}
    return samples, series


def ticks(lo, hi, count=5):
    step = (hi - lo) / count
    return [lo + i * step for i in range(count + 1)]


def main():
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    samples, series = read(sys.argv[1])
    title = sys.argv[3] if len(sys.argv) > 3 else "evaluation loss against samples"
    x_lo, x_hi = 0.0, max(samples)
    values = [v for s in series.values() for v in s]
    y_lo, y_hi = min(values), max(values)
    pad = (y_hi - y_lo) * 0.05 or 0.1
    y_lo, y_hi = y_lo - pad, y_hi + pad
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM

    def px(x):
        return LEFT + (x - x_lo) / (x_hi - x_lo) * plot_w

    def py(y):
        return TOP + (y_hi - y) / (y_hi - y_lo) * plot_h

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" '
           f'font-family="sans-serif" font-size="12">',
           f'<rect width="{WIDTH}" height="{HEIGHT}" fill="white"/>',
           f'<text x="{LEFT}" y="{TOP - 16}" font-size="14">{title}</text>',
           f'<rect x="{LEFT}" y="{TOP}" width="{plot_w}" height="{plot_h}" fill="none" stroke="#444"/>']
    for x in ticks(x_lo, x_hi):
        out.append(f'<line x1="{px(x):.1f}" y1="{TOP}" x2="{px(x):.1f}" y2="{TOP + plot_h}" stroke="#ddd"/>')
        out.append(f'<text x="{px(x):.1f}" y="{TOP + plot_h + 16}" text-anchor="middle">{x:.0f}</text>')
    for y in ticks(y_lo, y_hi):
        out.append(f'<line x1="{LEFT}" y1="{py(y):.1f}" x2="{LEFT + plot_w}" y2="{py(y):.1f}" stroke="#ddd"/>')
        out.append(f'<text x="{LEFT - 6}" y="{py(y) + 4:.1f}" text-anchor="end">{y:.3f}</text>')
    out.append(f'<text x="{LEFT + plot_w / 2}" y="{HEIGHT - 10}" text-anchor="middle">samples (both replicas)</text>')
    out.append(f'<text x="16" y="{TOP + plot_h / 2}" text-anchor="middle" '
               f'transform="rotate(-90 16 {TOP + plot_h / 2})">evaluation loss</text>')
    for i, (name, ys) in enumerate(series.items()):
        colour = COLOURS[i % len(COLOURS)]
        points = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in zip(samples, ys))
        out.append(f'<polyline points="{points}" fill="none" stroke="{colour}" stroke-width="2"/>')
        ly = TOP + 20 + 20 * i
        out.append(f'<line x1="{LEFT + plot_w + 12}" y1="{ly}" x2="{LEFT + plot_w + 36}" y2="{ly}" '
                   f'stroke="{colour}" stroke-width="2"/>')
        out.append(f'<text x="{LEFT + plot_w + 42}" y="{ly + 4}">{name}</text>')
    out.append("</svg>")
    with open(sys.argv[2], "w") as f:
        f.write("\n".join(out) + "\n")


if __name__ == "__main__":
    main()
