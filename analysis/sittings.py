"""A study's sittings in one table per kind: results/<study>/tables/<table>.parquet with a `sitting` column.

A study made over several sittings (results/stability: 23 report folders and pooled maps) commits, instead of one
folder per sitting, one Parquet file per table kind (per_run_final, per_run_eval, runs, stability_cells, ...) whose
rows are every sitting's rows of that table, named in the column `sitting` (the old folder's name: lr_1,
deep8_8terms_zen4_i, ...; the pooled lr map of the stability study is `lr_map`). `sitting_table` gives one
sitting's table back exactly as its report wrote it (same columns, same values, same dtypes as `pd.read_csv` of
the CSV it replaced), and a pooled source written `<study folder>@<sitting>` reads like a report folder
(moe_rl.analysis.stability's --pool takes both):

    fold_sittings({"lr_1": Path("outputs/lr_1/tables"), ...}, Path("results/stability/tables"))
    sitting_table("results/stability", "per_run_final", "lr_1")
    python -m moe_rl.analysis.stability --pool results/stability@lr_1 results/stability@lr_2 --out outputs/map

Values are stored typed: a column whose every written value is a number is int64 (all whole, written without a
point) or float64, anything else text; empty cells are nulls. Floats round-trip exactly (pandas writes the
shortest repr), so the CSV a sitting had and `sitting_table` agree value for value.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import pandas as pd

from moe_rl.errors import DataError

SITTING = "sitting"
SEPARATOR = "@"  # "<study folder>@<sitting>": one sitting of a folded study, where a report folder is expected
COLUMNS_KEY = b"moe_rl.sitting_columns"  # Parquet metadata: each sitting's own columns and dtypes, in CSV order


def fold_sittings(tables_of: dict[str, Path], out: Path, suffix: str = ".csv") -> list[Path]:
    """One Parquet file per table name found in the sittings' folders (`tables_of`: sitting -> folder of CSVs),
    rows in sitting order; returns the files written."""
    names = sorted({path.stem for folder in tables_of.values() for path in Path(folder).glob(f"*{suffix}")})
    out.mkdir(parents=True, exist_ok=True)
    return [_write_table(tables_of, name, out / f"{name}.parquet", suffix) for name in names]


def _write_table(tables_of: dict[str, Path], name: str, path: Path, suffix: str) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts, columns = [], {}
    for sitting, folder in tables_of.items():
        csv = Path(folder) / f"{name}{suffix}"
        if csv.is_file():
            text = pd.read_csv(csv, dtype=str, keep_default_na=False)
            columns[sitting] = {c: str(t) for c, t in pd.read_csv(csv).dtypes.items()}
            texts.append(text.assign(**{SITTING: sitting}))
    frame = pd.concat(texts, ignore_index=True).fillna("")
    frame = frame[[SITTING] + [c for c in frame.columns if c != SITTING]]
    table = pa.Table.from_pandas(frame.apply(_typed), preserve_index=False)
    metadata = {**(table.schema.metadata or {}), COLUMNS_KEY: json.dumps(columns).encode()}
    pq.write_table(table.replace_schema_metadata(metadata), path)
    return path


def _typed(text: pd.Series) -> pd.Series:
    """A column of CSV text as int64 or float64 when every written value is a number, else as text; "" -> null."""
    written = text[text != ""]
    numbers = pd.to_numeric(written, errors="coerce")
    if text.name == SITTING or numbers.isna().any():
        return text.where(text != "", None)
    if not written.str.contains(r"[.eEn]", regex=True).any():  # whole numbers as written: int (nullable)
        return pd.to_numeric(text.where(text != ""), errors="coerce").astype("Int64")
    return pd.to_numeric(text.where(text != ""), errors="coerce").astype("float64")


def sittings(study: str | Path, table: str) -> list[str]:
    """The sittings that have `table`, in the order they were folded."""
    return list(_columns(_parquet(study, table)))


def sitting_table(study: str | Path, table: str, sitting: str) -> pd.DataFrame:
    """One sitting's `table` as its report wrote it: its own columns, typed as `pd.read_csv` of that CSV."""
    path = _parquet(study, table)
    columns = _columns(path)
    if sitting not in columns:
        raise DataError(f"{path}: sitting {sitting!r} has no {table} table; sittings with one: "
                        f"{', '.join(columns)}")
    frame = pd.read_parquet(path, filters=[(SITTING, "==", sitting)])
    dtypes = columns[sitting]  # the CSV's own dtypes: a column whole here may hold fractions in another sitting
    return pd.read_csv(io.StringIO(frame[list(dtypes)].to_csv(index=False))).astype(dtypes)


def _parquet(study: str | Path, table: str) -> Path:
    path = Path(study) / "tables" / f"{table}.parquet"
    if not path.is_file():
        raise DataError(f"{path}: no such table (a folded study holds tables/<table>.parquet with a `sitting` "
                        "column: moe_rl.analysis.sittings)")
    return path


def _columns(path: Path) -> dict[str, dict[str, str]]:
    """sitting -> its columns (in its CSV's order) and the dtype `pd.read_csv` gave each."""
    import pyarrow.parquet as pq

    return json.loads(pq.read_schema(path).metadata[COLUMNS_KEY])


def is_sitting_source(source: str | Path) -> bool:
    """Whether a pooled source names one sitting of a folded study (`<study>@<sitting>`) rather than a folder."""
    return SEPARATOR in Path(source).name


def source_table(source: str | Path, table: str) -> pd.DataFrame:
    """`table` of a pooled source: a report folder's tables/<table>.csv, or a folded study's sitting."""
    if is_sitting_source(source):
        study, sitting = str(source).rsplit(SEPARATOR, 1)
        return sitting_table(study, table, sitting)
    path = Path(source) / "tables" / f"{table}.csv"
    if not path.is_file():
        raise DataError(f"{path}: no such table (a report folder holds tables/<table>.csv: moe-rl report or "
                        "python -m moe_rl.analysis.stability writes them)")
    return pd.read_csv(path)


def source_name(source: str | Path) -> str:
    """The name a pooled source gives its runs (`<name>/<run>`): the sitting, or the report folder's name."""
    return str(source).rsplit(SEPARATOR, 1)[1] if is_sitting_source(source) else Path(source).name
