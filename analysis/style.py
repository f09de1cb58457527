"""One look for every figure: colour-blind-safe colours, print-size fonts, and a fixed style per group.

Colours are the Okabe-Ito palette (Okabe & Ito 2008, "Color Universal Design"), distinguishable under the common
colour-vision deficiencies; yellow comes last because it is faint on white. Groups take colours in their sorted
order, so the same set of groups gets the same colours in every figure of a report; when groups differ only in
objective and routing mode, the colour is the objective's (OBJECTIVE_ORDER), the same in every report. The
routing mode, when it is a group key, sets the line style (native solid, R2 dashed, R3 dotted), so GRPO vs
GRPO+R2 stays readable in greyscale print. Sweeps over other fields (lr x depth x experts) get looks keyed to
the swept values (`keyed_looks`): colour from the first key, line style from the second, marker from the rest, a
discrete palette with a legend rather than a continuous colour bar. Churn heatmaps use viridis.

Figures are built on `matplotlib.figure.Figure` directly, without pyplot: no global backend or figure registry is
touched, and PNG/PDF are rendered by the Agg and PDF canvases.
"""

from __future__ import annotations

import functools
import io
import math
import numbers
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import matplotlib as mpl
from matplotlib.figure import Figure
from matplotlib.ticker import Formatter, LogLocator

OKABE_ITO = ["#0072B2", "#D55E00", "#009E73", "#CC79A7", "#E69F00", "#56B4E9", "#000000", "#F0E442"]
ROUTING_LINESTYLES = {"native": "-", "R2": "--", "R3": ":"}
# Objectives in the order of docs/design.md section 6: the colour of each when groups differ only in objective and
# routing mode. Objectives not listed take the following colours, in name order.
OBJECTIVE_ORDER = ("grpo", "gspo", "gspo_token", "dr_grpo", "dapo", "cispo", "gmpo")
MARKERS = ["o", "s", "^", "D", "v", "P", "X", "*"]
SEQUENTIAL_CMAP = "viridis"
DPI = 300
FORMATS = ("png",)  # results/ keeps PNG; pass formats=("png", "pdf") for a paper's figure
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


LINESTYLES = ["-", "--", ":", "-."]


def _rank(values: Sequence) -> list[int]:
    """Each value's index among the sorted distinct values (numbers as numbers, anything else as text)."""
    distinct = sorted(set(values), key=lambda v: (0, v, "") if isinstance(v, numbers.Number) else (1, 0, str(v)))
    return [distinct.index(v) for v in values]


def keyed_looks(groups: Sequence[str], key_values: Sequence[Sequence]) -> dict[str, Look]:
    """A Look per group from its group-key values (`key_values[i]` is group i's tuple): the first key picks the
    colour, the second the line style, the rest (combined) the marker, each in sorted value order. So a swept
    value has one look across the report's figures, and 30 groups of lr x depth x experts stay tellable apart."""
    columns = list(zip(*key_values)) if key_values and key_values[0] else []
    ranks = [_rank(column) for column in columns]
    looks = {}
    for i, group in enumerate(groups):
        colour = ranks[0][i] if ranks else i
        style = ranks[1][i] if len(ranks) > 1 else 0
        marker = 0
        for column in ranks[2:]:
            marker = marker * (max(column) + 1) + column[i]
        looks[group] = Look(OKABE_ITO[colour % len(OKABE_ITO)], LINESTYLES[style % len(LINESTYLES)],
                            MARKERS[marker % len(MARKERS)])
    return looks


MAX_SIGNIFICANT = 3  # percent labels carry at most this many significant digits unless neighbours need more


def _percent_decimals(percent: float) -> int:
    """The fewest decimals that write `percent` exactly, up to MAX_SIGNIFICANT significant digits."""
    if percent == 0 or not math.isfinite(percent):
        return 0
    first = -math.floor(math.log10(abs(percent)))  # decimals that reach the first significant digit
    for decimals in range(max(0, first), max(0, first + MAX_SIGNIFICANT - 1) + 1):
        if abs(round(percent, decimals) - percent) <= 1e-9 * abs(percent):
            return decimals
    return max(0, first + MAX_SIGNIFICANT - 1)


def _percent_label(value: float, decimals: int) -> str:
    if not math.isfinite(value):
        return ""
    text = f"{100 * value:.{decimals}f}"
    return ("0" if float(text) == 0 else text) + "%"


class PercentFormatter(Formatter):
    """Tick labels for fractions as percentages that are true and distinct: each tick gets the fewest decimals
    that write it exactly (0.05 -> 5%, 0.015 -> 1.5%, 0.0001 -> 0.01%, to MAX_SIGNIFICANT digits), and when two
    ticks of an axis would still read alike every label gets one more decimal until none do."""

    def __call__(self, value: float, pos=None) -> str:
        return _percent_label(value, _percent_decimals(100 * value))

    def format_ticks(self, values) -> list[str]:
        decimals = [_percent_decimals(100 * v) for v in values]
        for extra in range(8):
            labels = [_percent_label(v, d + extra) for v, d in zip(values, decimals)]
            if len(set(labels)) == len(labels):
                break
        return labels


class NarrowLogLocator(LogLocator):
    """Decade ticks, plus 2x and 5x ticks when fewer than two decades lie in view (else a narrow log axis shows
    a single labelled tick, or none)."""

    def tick_values(self, vmin, vmax):
        low, high = sorted((vmin, vmax))
        narrow = low > 0 and math.floor(math.log10(high) + 1e-9) - math.ceil(math.log10(low) - 1e-9) < 1
        self.set_params(subs=(1.0, 2.0, 5.0) if narrow else (1.0,))
        return super().tick_values(vmin, vmax)


def percent_formatter() -> PercentFormatter:
    """The formatter of every percent axis (see PercentFormatter)."""
    return PercentFormatter()


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
    """Write `name`.<format> for each of `formats` (PNG at DPI dots per inch, 256 colours; PDF on request) into
    `folder`, cut to the drawn artists (bbox "tight") so that no label is clipped; PDFs carry no creation date so that
    the same data gives the same file."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    with paper():
        for fmt in formats:
            path = folder / f"{name}.{fmt}"
            if fmt == "png":
                _save_png(fig, path)
            else:
                metadata = {"CreationDate": None} if fmt == "pdf" else None
                fig.savefig(path, format=fmt, metadata=metadata, bbox_inches="tight", pad_inches=0.03)
            paths.append(path)
    return paths


def _save_png(fig: Figure, path: Path) -> None:
    """A PNG of 256 colours: line plots with translucent bands look the same and take a third of the bytes of
    full colour, which keeps results/ within its budget (tests/test_results_folder.py)."""
    from PIL import Image

    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", bbox_inches="tight", pad_inches=0.03)
    image = Image.open(buffer).convert("RGB")
    image.quantize(colors=256, method=Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE).save(path, optimize=True)
