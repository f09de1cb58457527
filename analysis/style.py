"""One look for every figure: colour-blind-safe colours, print-size fonts, and a fixed style per group.

Colours are the Okabe-Ito palette (Okabe & Ito 2008, "Color Universal Design"), distinguishable under the common
colour-vision deficiencies; yellow comes last because it is faint on white. Groups take colours in their sorted
order, so the same set of groups gets the same colours in every figure of a report; when groups differ only in
objective and routing mode, the colour is the objective's (OBJECTIVE_ORDER), the same in every report. The
routing mode, when it is a group key, sets the line style (native solid, R2 dashed, R3 dotted), so GRPO vs
GRPO+R2 stays readable in greyscale print. Sequential quantities (learning rate, churn heatmaps) use viridis.

Figures are built on `matplotlib.figure.Figure` directly, without pyplot: no global backend or figure registry is
touched, and PNG/PDF are rendered by the Agg and PDF canvases.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import matplotlib as mpl
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter

OKABE_ITO = ["#0072B2", "#D55E00", "#009E73", "#CC79A7", "#E69F00", "#56B4E9", "#000000", "#F0E442"]
ROUTING_LINESTYLES = {"native": "-", "R2": "--", "R3": ":"}
# Objectives in the order of docs/design.md section 6: the colour of each when groups differ only in objective and
# routing mode. Objectives not listed take the following colours, in name order.
OBJECTIVE_ORDER = ("grpo", "gspo", "gspo_token", "dr_grpo", "dapo", "cispo", "gmpo")
MARKERS = ["o", "s", "^", "D", "v", "P", "X", "*"]
SEQUENTIAL_CMAP = "viridis"
DPI = 300
FORMATS = ("png", "pdf")
PAGE_WIDTH = 7.0  # inches: the text width of a two-column paper

RC = {
    "font.size": 8, "axes.titlesize": 8, "axes.labelsize": 8, "xtick.labelsize": 7, "ytick.labelsize": 7,
    "legend.fontsize": 7, "legend.frameon": False, "axes.spines.top": False, "axes.spines.right": False,
    "axes.grid": True, "grid.alpha": 0.3, "grid.linewidth": 0.5, "lines.linewidth": 1.3, "lines.markersize": 4,
    "figure.dpi": 100, "savefig.dpi": DPI,
    "pdf.fonttype": 42, "ps.fonttype": 42,  # embed TrueType: text stays text (journals ask for it)
    "image.cmap": SEQUENTIAL_CMAP,
}


@dataclass(frozen=True)
class Look:
    color: str
    linestyle: str
    marker: str


def group_looks(groups: Sequence[str], routing_modes: Sequence[str | None] | None = None,
                objectives: Sequence[str] | None = None) -> dict[str, Look]:
    """A Look per group label. Colours follow the groups' order, or, given each group's objective, the objective
    (OBJECTIVE_ORDER; so GRPO has one colour in every report); `routing_modes[i]` sets group i's line style."""
    if objectives is not None:
        unknown = sorted(set(objectives) - set(OBJECTIVE_ORDER))
        slots = [(OBJECTIVE_ORDER + tuple(unknown)).index(name) for name in objectives]
    else:
        slots = list(range(len(groups)))
    looks = {}
    for i, (group, slot) in enumerate(zip(groups, slots)):
        mode = routing_modes[i] if routing_modes is not None else None
        looks[group] = Look(OKABE_ITO[slot % len(OKABE_ITO)], ROUTING_LINESTYLES.get(mode, "-"),
                            MARKERS[(slot // len(OKABE_ITO)) % len(MARKERS)])
    return looks


def percent_formatter() -> FuncFormatter:
    """Tick labels for fractions as percentages with as many decimals as the value needs (0.01%, 0.5%, 10%), so
    the decades of a log axis stay distinguishable."""

    def label(value: float, _position) -> str:
        if value <= 0 or not math.isfinite(value):
            return "0%"
        percent = 100 * value
        decimals = max(0, -math.floor(math.log10(percent) + 1e-9))
        return f"{percent:.{decimals}f}%"

    return FuncFormatter(label)


@contextmanager
def paper() -> Iterator[None]:
    """rcParams for print-size figures, for the duration of the block."""
    with mpl.rc_context(RC):
        yield


def in_paper_style(make: Callable) -> Callable:
    """Run a figure-making function under `paper()`: rcParams are read when artists are created, not drawn."""

    @functools.wraps(make)
    def wrapper(*args, **kwargs):
        with paper():
            return make(*args, **kwargs)

    return wrapper


def new_figure(n_rows: int = 1, n_cols: int = 1, *, width: float = PAGE_WIDTH, row_height: float = 2.4,
               **subplot_kw):
    """A Figure and its axes (always a 2-D array); call it inside `paper()` or an `in_paper_style` function."""
    fig = Figure(figsize=(width, row_height * n_rows), layout="constrained")
    return fig, fig.subplots(n_rows, n_cols, squeeze=False, **subplot_kw)


def save(fig: Figure, folder: str | Path, name: str, formats: Sequence[str] = FORMATS) -> list[Path]:
    """Write `name`.png (DPI dots per inch) and `name`.pdf into `folder`; PDFs carry no creation date so that
    the same data gives the same file."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    with paper():
        for fmt in formats:
            path = folder / f"{name}.{fmt}"
            metadata = {"CreationDate": None} if fmt == "pdf" else None
            fig.savefig(path, format=fmt, metadata=metadata)
            paths.append(path)
    return paths
