"""Bar and line charts as small standalone SVGs (no plotting library needed)."""

from __future__ import annotations

from html import escape
from pathlib import Path

COLOURS = ("#2f6f4f", "#7fb069", "#d08c60", "#8c6bb1", "#5b8bd9")


def bar_chart(
    path: Path, title: str, groups: list[str], series: dict[str, list[float]], unit: str
) -> None:
    """Bars of each series side by side per group, values written on top."""
    width, height, left, bottom, top = 720, 360, 70, 50, 50
    plot_w, plot_h = width - left - 20, height - top - bottom
    peak = max((v for values in series.values() for v in values), default=1.0) or 1.0
    group_w = plot_w / len(groups)
    bar_w = group_w * 0.8 / len(series)
    parts = _frame(
        title, unit, width=width, height=height, left=left, top=top, plot_w=plot_w, plot_h=plot_h
    )
    for g, group in enumerate(groups):
        x0 = left + g * group_w + group_w * 0.1
        parts.append(
            f'<text x="{left + (g + 0.5) * group_w}" y="{top + plot_h + 20}" '
            f'text-anchor="middle">{escape(group)}</text>'
        )
        for s, (name, values) in enumerate(series.items()):
            value = values[g]
            h = plot_h * value / peak
            x = x0 + s * bar_w
            y = top + plot_h - h
            parts.append(
                f'<rect x="{x:.1f}" y="{y:.1f}" width="{bar_w - 2:.1f}" height="{h:.1f}" '
                f'fill="{COLOURS[s % len(COLOURS)]}"><title>{escape(name)}: {value:.0f}</title>'
                "</rect>"
            )
            parts.append(
                f'<text x="{x + bar_w / 2 - 1:.1f}" y="{y - 4:.1f}" text-anchor="middle" '
                f'font-size="10">{value:.0f}</text>'
            )
    for s, name in enumerate(series):
        y = top + plot_h + 38
        x = left + s * 170
        parts.append(
            f'<rect x="{x}" y="{y - 10}" width="12" height="12" '
            f'fill="{COLOURS[s % len(COLOURS)]}"/>'
            f'<text x="{x + 18}" y="{y}">{escape(name)}</text>'
        )
    _write(path, parts)


def line_chart(
    path: Path, title: str, xs: list[str], series: dict[str, list[float]], unit: str
) -> None:
    """One polyline per series over the same x labels, a dot per value."""
    width, height, left, bottom, top = 760, 380, 70, 70, 50
    plot_w, plot_h = width - left - 20, height - top - bottom
    peak = max((v for values in series.values() for v in values), default=1.0) or 1.0
    step = plot_w / max(len(xs) - 1, 1)
    parts = _frame(
        title, unit, width=width, height=height, left=left, top=top, plot_w=plot_w, plot_h=plot_h
    )
    parts += [
        f'<line x1="{left}" y1="{top}" x2="{left}" y2="{top + plot_h}" stroke="#444"/>',
        f'<text x="{left - 6}" y="{top + 4}" text-anchor="end">{peak:.2f}</text>',
        f'<text x="{left - 6}" y="{top + plot_h}" text-anchor="end">0</text>',
    ]
    for i, label in enumerate(xs):
        parts.append(
            f'<text x="{left + i * step:.1f}" y="{top + plot_h + 16}" '
            f'text-anchor="middle" font-size="10">{escape(label)}</text>'
        )
    for s, (name, values) in enumerate(series.items()):
        colour = COLOURS[s % len(COLOURS)]
        points = [(left + i * step, top + plot_h - plot_h * v / peak) for i, v in enumerate(values)]
        parts.append(
            f'<polyline fill="none" stroke="{colour}" stroke-width="2" points="'
            + " ".join(f"{x:.1f},{y:.1f}" for x, y in points)
            + '"/>'
        )
        parts.extend(
            f'<circle cx="{x:.1f}" cy="{y:.1f}" r="2.5" fill="{colour}">'
            f"<title>{escape(name)}: {v:.2f}</title></circle>"
            for (x, y), v in zip(points, values, strict=True)
        )
        y = top + plot_h + 36 + 16 * (s // 2)
        x = left + (s % 2) * 330
        parts.append(
            f'<rect x="{x}" y="{y - 10}" width="12" height="12" fill="{colour}"/>'
            f'<text x="{x + 18}" y="{y}">{escape(name)}</text>'
        )
    _write(path, parts)


def _frame(
    title: str, unit: str, *, width: int, height: int, left: int, top: int, plot_w: int, plot_h: int
) -> list[str]:
    """The SVG's opening, background, title, x axis and unit."""
    return [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        'font-family="sans-serif" font-size="12">',
        f'<rect width="{width}" height="{height}" fill="white"/>',
        f'<text x="{width / 2}" y="22" text-anchor="middle" font-size="15">{escape(title)}</text>',
        f'<line x1="{left}" y1="{top + plot_h}" x2="{left + plot_w}" y2="{top + plot_h}" '
        'stroke="#444"/>',
        f'<text x="16" y="{top + plot_h / 2}" transform="rotate(-90 16 {top + plot_h / 2})" '
        f'text-anchor="middle">{escape(unit)}</text>',
    ]


def _write(path: Path, parts: list[str]) -> None:
    parts.append("</svg>")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(parts) + "\n")
