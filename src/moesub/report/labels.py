"""Point labels that do not overlap: a small greedy, deterministic placement.

Scatter plots label each point with a short key (the policy's number in the report's policy
table). Points that coincide on screen share one label ("3,4,7"). Labels are placed one by one,
in a fixed order, at the first candidate offset (rings of growing radius around the point) whose
box, with a margin of `GAP_PX` (so that "11" and "13" never read as "1113"), overlaps no label
placed before and no point, preferably inside the axes (else the least overlap); a label moved
away from its point gets a thin leader line. Everything is in display
pixels after the figure's layout is final, so the result is the same on every run.
"""

from __future__ import annotations

from collections.abc import Sequence

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.transforms import Bbox

MERGE_PX = 3.0  # points closer than this on screen share one label
POINT_PX = 5.0  # half the size of a marker's box, kept free of labels
GAP_PX = 3.0  # the least space between two labels
RADII_PX = (7.0, 13.0, 20.0, 28.0, 38.0, 50.0, 64.0, 80.0, 100.0, 125.0)
ANGLES = np.deg2rad([45, 135, -45, -135, 90, -90, 0, 180, 20, 160, -20, -160, 70, 110, -70, -110])


def _boxes_overlap(a: Bbox, b: Bbox) -> float:
    w = min(a.x1, b.x1) - max(a.x0, b.x0)
    h = min(a.y1, b.y1) - max(a.y0, b.y0)
    return w * h if w > 0 and h > 0 else 0.0


def merge_coincident(
    xy_px: np.ndarray, texts: Sequence[str]
) -> list[tuple[np.ndarray, str, list[int]]]:
    """Group points within MERGE_PX of a group's first point: (position, joined text, members).

    xy_px: (N, 2) display coordinates. Order: by x, then y, then text (deterministic).
    """
    order = sorted(range(len(texts)), key=lambda i: (xy_px[i, 0], xy_px[i, 1], texts[i]))
    groups: list[tuple[np.ndarray, list[int]]] = []
    for i in order:
        for pos, members in groups:
            if np.hypot(*(xy_px[i] - pos)) <= MERGE_PX:
                members.append(i)
                break
        else:
            groups.append((xy_px[i], [i]))
    out = []
    for pos, members in groups:
        seen: list[str] = []
        for i in members:
            if texts[i] not in seen:
                seen.append(texts[i])
        out.append((pos, ",".join(seen), members))
    return out


def place_labels(
    ax: plt.Axes,
    xs: Sequence[float],
    ys: Sequence[float],
    texts: Sequence[str],
    fontsize: float = 7.0,
) -> list[plt.Annotation]:
    """Annotate (xs[i], ys[i]) with texts[i] without overlaps; call after the layout is final.

    Non-finite points are skipped. Returns the annotations (one per group of coincident points).
    """
    fig = ax.figure
    x = np.asarray(xs, dtype=float)
    y = np.asarray(ys, dtype=float)
    keep = np.isfinite(x) & np.isfinite(y)
    if not keep.any():
        return []
    texts = [t for t, k in zip(texts, keep, strict=True) if k]
    xy_px = ax.transData.transform(np.column_stack([x[keep], y[keep]]))  # (N, 2)
    renderer = fig.canvas.get_renderer()
    frame = ax.get_window_extent(renderer)
    points = [
        Bbox.from_extents(px - POINT_PX, py - POINT_PX, px + POINT_PX, py + POINT_PX)
        for px, py in xy_px
    ]
    placed: list[Bbox] = []
    out = []
    px_to_pt = 72.0 / fig.dpi
    for pos, text, _members in merge_coincident(xy_px, texts):
        xy = ax.transData.inverted().transform(pos)
        style = {"fontsize": fontsize, "ha": "center", "va": "center", "zorder": 5}
        probe = ax.annotate(text, xy=xy, xytext=(0, 0), textcoords="offset points", **style)
        best: tuple[float, float, float, Bbox] | None = None
        for radius in RADII_PX:
            for angle in ANGLES:
                dx, dy = radius * np.cos(angle), radius * np.sin(angle)
                probe.xyann = (dx * px_to_pt, dy * px_to_pt)
                box = probe.get_window_extent(renderer)
                # shift the box so its nearest edge, not its centre, sits at the offset
                sx = np.sign(np.round(dx, 6)) * box.width / 2
                sy = np.sign(np.round(dy, 6)) * box.height / 2
                box = Bbox.from_extents(box.x0 + sx, box.y0 + sy, box.x1 + sx, box.y1 + sy)
                padded = box.padded(GAP_PX)
                cost = sum(_boxes_overlap(padded, b) for b in placed)
                cost += sum(_boxes_overlap(box, b) for b in points)
                # outside the axes is allowed (the saved figure grows to fit) but not preferred
                cost += 0.5 * (box.width * box.height - _boxes_overlap(box, frame))
                if best is None or cost < best[0]:
                    best = (cost, dx + sx, dy + sy, box)
                if cost == 0:
                    break
            if best is not None and best[0] == 0:
                break
        probe.remove()
        assert best is not None
        _, dx, dy, box = best
        far = np.hypot(dx, dy) > RADII_PX[1] + max(box.width, box.height) / 2
        arrow = {"arrowstyle": "-", "color": "grey", "lw": 0.5, "shrinkA": 0, "shrinkB": 3}
        ann = ax.annotate(
            text,
            xy=xy,
            xytext=(dx * px_to_pt, dy * px_to_pt),
            textcoords="offset points",
            arrowprops=arrow if far else None,
            **style,
        )
        placed.append(box)
        out.append(ann)
    return out


def key_text(numbers: dict[str, int], shown: Sequence[str], width: int = 28) -> str:
    """The figure's key: one "n  policy" line per policy shown, in number order."""
    names = sorted(set(shown), key=lambda n: numbers.get(n, 10**6))
    return "\n".join(f"{numbers.get(n, '?'):>2}  {n[:width]}" for n in names)
