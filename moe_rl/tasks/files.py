"""Problems from local JSONL or Parquet files, read with the `datasets` library (offline).

Format: one problem per JSON line (.jsonl, .json) or Parquet row (.parquet), with a prompt column and an answer
column (names configurable; other columns are ignored). The prompt is used as is; the answer may be text or a number
(numbers become text with str(); Arrow reads a JSON column mixing 4 and 4.5 as floats, so 4 becomes "4.0": write
answers as strings when match="exact"). Blank JSONL lines are skipped. The verifier is answer.py's numeric or exact
match.

Splits: with `eval_path`, train is every row of `path` and eval every row of `eval_path`. Without it, a permutation
seeded by `seed` holds out round(eval_fraction * rows) rows of `path` (at least 1, leaving at least 1) for eval.
Index i of eval is eval row i mod n_eval, in file order; index i of train is position i mod n_train of epoch
i // n_train, each epoch in its own seeded order. A data position is one integer, so resume is exact. There is no
validation split (every row is already train or eval): asking for one raises ConfigError.

Errors are DataErrors naming the file and, for one record, its line (JSONL, 1-based, blank lines counted) or row
(Parquet, 1-based): a missing file, an unknown suffix, a line that is not UTF-8, not JSON or not a JSON object, a
column whose JSON type changes between lines, an empty file, a missing column (listing the columns present), an
empty prompt or missing answer, a non-numeric answer under match="numeric", a character the tokenizer cannot encode.
We scan JSONL line by line with json.loads before `datasets` sees it, because its errors do not name the line.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moe_rl.errors import ConfigError, DataError, check_choice
from moe_rl.tasks.answer import MATCHERS, parse_number
from moe_rl.tasks.base import Problem, Task, check_split_index
from moe_rl.tasks.tokenizer import CharTokenizer, Tokenizer

SUFFIXES = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}


def _json_kind(value: Any) -> str:
    """The JSON type of a parsed value, as Arrow sees it (int and float are both "number")."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    return {str: "string", list: "array", dict: "object"}[type(value)]


def scan_jsonl(path: Path) -> list[int]:
    """Check every non-blank line of a JSONL file; return their 1-based line numbers (row i -> line numbers[i])."""
    numbers: list[int] = []
    kinds: dict[str, tuple[str, int]] = {}  # column -> (JSON type, line where first seen)
    with path.open("rb") as f:
        for n, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise DataError(f"{path}, line {n}: not UTF-8 ({err.reason} at byte {err.start})") from None
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise DataError(f"{path}, line {n}: not valid JSON ({err.msg} at column {err.colno})"
                                f"{_json_lines_hint(line)}") from None
            if not isinstance(record, dict):
                raise DataError(f"{path}, line {n}: expected a JSON object, got {_json_kind(record)}"
                                f"{_json_lines_hint(line)}")
            _check_kinds(record, kinds, path, n)
            numbers.append(n)
    if not numbers:
        raise DataError(f"{path} is empty: it has no JSON lines")
    return numbers


def _json_lines_hint(line: str) -> str:
    """What to say when a line that opens a JSON array (or a pretty-printed object) is not one problem."""
    if line.lstrip().startswith("[") or line.strip() == "{":
        return ("; a task file (.jsonl or .json) is JSON Lines, one JSON object per line, not a JSON array or a "
                "pretty-printed document")
    return ""


def _check_kinds(record: dict, kinds: dict[str, tuple[str, int]], path: Path, n: int) -> None:
    """Refuse a column whose JSON type differs from earlier lines: Arrow needs one type per column."""
    for column, value in record.items():
        kind = _json_kind(value)
        if kind == "null":
            continue
        first = kinds.setdefault(column, (kind, n))
        if first[0] != kind:
            raise DataError(
                f"{path}, line {n}: column {column!r} is a {kind} here but a {first[0]} on line {first[1]}; "
                "use one type per column (e.g. write every answer as a string)"
            )


def scan_parquet(path: Path) -> None:
    """Refuse a file that is not Parquet or has no rows (datasets fails on both without saying so)."""
    import pyarrow.parquet as pq

    try:
        rows = pq.read_metadata(path).num_rows
    except Exception as err:  # pyarrow raises ArrowInvalid, OSError, ... for a file that is not Parquet
        raise DataError(f"{path}: not a readable Parquet file ({err})") from None
    if rows == 0:
        raise DataError(f"{path} is empty: it has no rows")


@dataclass
class FileReader:
    """Reads one file into Problems, checking every record. Columns, match mode and tokenizer as in TaskConfig."""

    prompt_column: str = "prompt"
    answer_column: str = "answer"
    match: str = "numeric"
    tokenizer: Tokenizer | None = None
    cache_dir: str | None = None

    def read(self, path: str | Path) -> list[Problem]:
        """File -> one Problem per record, in file order; meta holds the file and the line or row."""
        path = Path(path)
        kind = self._kind(path)
        lines = scan_jsonl(path) if kind == "json" else scan_parquet(path)
        dataset = self._load(kind, path)
        self._check_columns(path, dataset.column_names)
        records = zip(dataset[self.prompt_column], dataset[self.answer_column])
        return [self._problem(path, f"line {lines[i]}" if lines else f"row {i + 1}", prompt, answer)
                for i, (prompt, answer) in enumerate(records)]

    @staticmethod
    def _kind(path: Path) -> str:
        if not path.exists():
            raise DataError(f"{path}: file not found")
        if not path.is_file():
            what = "a directory" if path.is_dir() else "not a regular file (a FIFO, a device or a socket)"
            raise DataError(f"{path} is {what}; task.path and task.eval_path must name a .jsonl, .json or .parquet "
                            "file")
        if path.suffix.lower() not in SUFFIXES:
            raise DataError(f"{path}: unknown file type {path.suffix!r}; use one of {', '.join(SUFFIXES)}")
        return SUFFIXES[path.suffix.lower()]

    def _load(self, kind: str, path: Path) -> Any:
        import datasets  # lazy: about 1 s to import, and only file tasks need it

        # Its progress bars would be the only lines on stderr of a run refused later (one line is the contract).
        shown = datasets.is_progress_bar_enabled()
        datasets.disable_progress_bars()
        try:
            return datasets.load_dataset(kind, data_files=str(path), split="train", cache_dir=self.cache_dir)
        except Exception as err:  # Arrow's own messages; we have already ruled out what we can name by line
            raise DataError(f"{path}: datasets could not read it: {err}") from err
        finally:
            if shown:
                datasets.enable_progress_bars()

    def _check_columns(self, path: Path, present: list[str]) -> None:
        for column in (self.prompt_column, self.answer_column):
            if column not in present:
                raise DataError(f"{path}: no column {column!r}; columns present: {', '.join(present)}")

    def _problem(self, path: Path, where: str, prompt: Any, answer: Any) -> Problem:
        """One record -> Problem, or a DataError naming `path` and `where` (line or row)."""
        if not isinstance(prompt, str) or not prompt:
            raise DataError(f"{path}, {where}: prompt column {self.prompt_column!r} is empty or not text: {prompt!r}")
        if answer is None or str(answer).strip() == "":
            raise DataError(f"{path}, {where}: answer column {self.answer_column!r} is empty")
        answer = str(answer).strip()
        if self.match == "numeric" and parse_number(answer) is None:
            raise DataError(f"{path}, {where}: answer {answer!r} is not a number, but match='numeric'")
        tokenizer = self.tokenizer or CharTokenizer()
        for column, text in ((self.prompt_column, prompt), (self.answer_column, answer)):
            try:
                tokenizer.encode(text)
            except ValueError as err:
                raise DataError(f"{path}, {where}: column {column!r}: {err}") from None
        return Problem(prompt, answer, {"file": str(path), "where": where})


def holdout(rows: list[Problem], fraction: float, seed: int, path: str) -> dict[str, list[Problem]]:
    """Split one file's rows into train and eval by a permutation seeded with `seed`; each keeps file order."""
    n = len(rows)
    if n < 2:
        raise DataError(f"{path}: {n} row; holding out an eval split needs at least 2 rows (or set eval_path)")
    n_eval = min(n - 1, max(1, round(fraction * n)))
    order = list(range(n))
    random.Random(f"{seed}:holdout").shuffle(order)
    return {"train": [rows[i] for i in sorted(order[n_eval:])], "eval": [rows[i] for i in sorted(order[:n_eval])]}


class FileTask(Task):
    """Problems from a JSONL or Parquet file (and optionally a separate eval file); numeric or exact match."""

    def __init__(self, path: str, eval_path: str | None = None, *, prompt_column: str = "prompt",
                 answer_column: str = "answer", match: str = "numeric", seed: int = 0, eval_fraction: float = 0.1,
                 tokenizer: Tokenizer | None = None, cache_dir: str | None = None):
        """Read and check the file(s) now, so that a bad record fails before training starts."""
        check_choice("match", match, MATCHERS)
        reader = FileReader(prompt_column, answer_column, match, tokenizer, cache_dir)
        self.name = f"file:{Path(path).name}"
        self._verify = MATCHERS[match]
        self._seed = seed
        rows = reader.read(path)
        if eval_path:
            self._splits = {"train": rows, "eval": reader.read(eval_path)}
        else:
            self._splits = holdout(rows, eval_fraction, seed, path)
        self._epoch_order: tuple[int, list[int]] = (-1, [])

    def num_problems(self, split: str) -> int:
        """Rows in `split`; indices beyond wrap around (train in a new order each epoch)."""
        return len(self._rows(split))

    def _rows(self, split: str) -> list[Problem]:
        check_split_index(split, 0)
        if split not in self._splits:
            raise ConfigError(f"{self.name}: a file task has train and eval splits only, no {split} split")
        return self._splits[split]

    def problem(self, split: str, index: int) -> Problem:
        """Row index mod n of `split`; for train, in the seeded order of epoch index // n."""
        check_split_index(split, index)
        rows = self._rows(split)
        epoch, position = divmod(index, len(rows))
        if split == "train":
            position = self._order(epoch)[position]
        row = rows[position]
        return Problem(row.prompt, row.answer, {**row.meta, "split": split, "index": index})

    def _order(self, epoch: int) -> list[int]:
        """The train row order of `epoch`; the last one is kept, since a trainer reads epochs in sequence."""
        if self._epoch_order[0] != epoch:
            order = list(range(len(self._splits["train"])))
            random.Random(f"{self._seed}:train-epoch:{epoch}").shuffle(order)
            self._epoch_order = (epoch, order)
        return self._epoch_order[1]

    def reward(self, problem: Problem, completion: str) -> float:
        """Numeric or exact match of the completion against the row's answer (answer.py)."""
        return self._verify(completion, problem.answer)
