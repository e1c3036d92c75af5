"""What every report figure is drawn with: the `Figure` record, the `FigureData` a figure function
gets (its tables without unconfigured policies, its models in the analysis' order), one panel
row per model (`panels`, `rows_of`), numbered points with a key (`finish`: label only the rows
given, e.g. a front, where points crowd), and the PNG / data-URI writer (`png_data_uri`). Agg
backend, no display needed.
"""

from __future__ import annotations

import base64
import io
from dataclasses import dataclass
from pathlib import Path

import matplotlib
import numpy as np
import pandas as pd

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import ScalarFormatter  # noqa: E402

from moesub.io import atomic_path  # noqa: E402
from moesub.report.labels import key_text, place_labels  # noqa: E402
from moesub.report.load import AnalysisOutputs, ci_label, unique  # noqa: E402

DPI = 110
PANEL = (5.2, 3.6)  # inches per panel


@dataclass
class Figure:
    """One figure of the report: its id, caption, PNG path and inline data URI (or why not)."""

    name: str
    title: str
    caption: str
    png: Path | None = None
    data_uri: str | None = None
    missing: str | None = None


@dataclass
class FigureData:
    """What every figure function gets: the analysis outputs and the policy numbers."""

    out: AnalysisOutputs
    numbers: dict[str, int]

    @property
    def ci(self) -> str:
        return ci_label(self.out.ci_level)

    def models(self, df: pd.DataFrame) -> list[str]:
        """The models of `df`, in the analysis' order (one order in every figure)."""
        if "model" not in df.columns:
            return [""]
        rank = {m: i for i, m in enumerate(self.out.models)}
        return sorted(unique(df["model"].astype(str)), key=lambda m: rank.get(m, len(rank)))

    def table(self, name: str) -> pd.DataFrame:
        """An analysis table without the rows of policies the config does not define (no
        figure shows a policy that is not configured)."""
        df = self.out.table(name)
        if "policy" not in df.columns:
            return df
        return df[[self.out.configured(str(x)) for x in df["policy"]]]


def panels(
    n_models: int, n_cols: int, width: float = PANEL[0], **kw
) -> tuple[plt.Figure, np.ndarray]:
    """(fig, axes (n_models, n_cols)): one row of panels per model, `width` inches each."""
    fig, axes = plt.subplots(
        n_models,
        n_cols,
        figsize=(width * n_cols, PANEL[1] * n_models),
        squeeze=False,
        **kw,
    )
    return fig, axes


def rows_of(df: pd.DataFrame, model: str) -> pd.DataFrame:
    return df[df["model"].astype(str) == model] if "model" in df.columns else df


def finish(
    fig: plt.Figure, fd: FigureData, labelled: list[tuple[plt.Axes, pd.DataFrame, str, str]]
):
    """Lay the figure out, then number the points of each `(ax, rows, x, y)` (the rows to
    label: all of a panel's, or a front) and add the key of the policies labelled."""
    shown: list[str] = []
    for _, df, _, _ in labelled:
        shown.extend(df["policy"].astype(str))
    key = key_text(fd.numbers, shown)
    fig.tight_layout(rect=(0, 0, 0.86 if key else 1, 1))
    for ax, df, x, y in labelled:
        texts = [str(fd.numbers.get(p, "?")) for p in df["policy"].astype(str)]
        place_labels(ax, df[x].to_numpy(float), df[y].to_numpy(float), texts)
    if key:
        fig.text(0.87, 0.98, key, va="top", ha="left", fontsize=7, family="monospace")
    return fig


def symlog_if_wide(ax: plt.Axes, values: pd.Series) -> None:
    v = values.to_numpy(float)
    v = v[np.isfinite(v)]
    if v.size and v.max() > 50:
        ax.set_yscale("symlog", linthresh=1.0)
        ax.yaxis.set_major_formatter(ScalarFormatter())
        ax.set_ylim(bottom=min(0.0, float(v.min())))


def png_data_uri(fig: plt.Figure, path: Path) -> str:
    """Write `fig` as a PNG at `path` (atomically) and return the same bytes as a data URI."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI, bbox_inches="tight", metadata={"Software": None})
    plt.close(fig)
    data = buf.getvalue()
    with atomic_path(path, suffix=".png") as tmp:
        tmp.write_bytes(data)
    return "data:image/png;base64," + base64.b64encode(data).decode("ascii")


STUDY_POLICIES = ("quality", "speed")  # numbered in a crowded scatter besides its front


def front_or_study(df: pd.DataFrame, front: str) -> pd.Series:
    """The rows a crowded scatter numbers: its Pareto front (column `front`) and the study's
    quality and speed policies."""
    return df[front].astype(bool) | df["policy"].isin(STUDY_POLICIES)


# the markers of a Pareto front's style column in words (the same in every figure)
FRONT_MARKERS = {"on the Pareto front": "X", "off the front": "o"}


def front_words(df: pd.DataFrame, front: str) -> pd.Series:
    """A Pareto-front column in words, for a legend (not True / False); draw it with
    `markers=FRONT_MARKERS`."""
    return df[front].astype(bool).map({True: "on the Pareto front", False: "off the front"})


def legend_below(ax: plt.Axes, ncol: int = 2) -> None:
    """The axes' legend under the plot, never over the data."""
    if ax.get_legend_handles_labels()[0]:
        ax.legend(
            fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=ncol, frameon=False
        )
