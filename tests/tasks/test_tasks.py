"""Tasks: tokenizer, answer format, reasoning-gym tasks and verifiers, local files and their error messages."""

from __future__ import annotations

import json
import os

# Everything here is local; never let `datasets` reach for the hub.
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pandas as pd
import pytest

from moe_rl.errors import ConfigError, DataError
from moe_rl.tasks import CharTokenizer, FileTask, GymTask, Problem, TaskConfig, build_task, build_tokenizer
from moe_rl.tasks.answer import exact_reward, numeric_reward, parse_number
from moe_rl.tasks.expr import countdown_reward, evaluate
from moe_rl.tasks.tokenizer import Tokenizer

# ---------------------------------------------------------------- tokenizer


def test_char_tokenizer_specials_and_vocab():
    tok = build_tokenizer("char")
    assert isinstance(tok, Tokenizer)
    assert (tok.pad_id, tok.bos_id, tok.eos_id, tok.vocab_size) == (0, 1, 2, 99)
    assert tok.encode(" ") == [3] and tok.encode("~") == [97] and tok.encode("\n") == [98]


def test_char_tokenizer_round_trip_and_decode_rules():
    tok = CharTokenizer()
    text = "".join(chr(c) for c in range(32, 127)) + "\n"
    ids = tok.encode(text)
    assert len(ids) == len(text) and len(set(ids)) == len(text)
    assert tok.decode(ids) == text
    # decode skips PAD and BOS and stops at the first EOS (excluded)
    row = [tok.bos_id] + tok.encode("4-1=") + [tok.pad_id] + tok.encode("3") + [tok.eos_id] + tok.encode("junk")
    assert tok.decode(row) == "4-1=3"


def test_char_tokenizer_refuses_unknown_character_and_id():
    tok = CharTokenizer()
    with pytest.raises(ValueError, match="'é'"):
        tok.encode("café")
    with pytest.raises(ValueError, match="99"):
        tok.decode([5, 99])


# ---------------------------------------------------------------- answer format


@pytest.mark.parametrize("completion, answer, expected", [
    ("-4", "-4", 1.0), ("-4.0", "-4", 1.0), (" -4\n", "-4", 1.0), ("+4", "4", 1.0), ("4.", "4", 1.0),
    ("0.5", ".5", 1.0), ("1e3", "1000", 1.0), ("0.3333333", "0.33333333", 1.0),
    ("-5", "-4", 0.0), ("4", "-4", 0.0), ("", "4", 0.0), ("4 apples", "4", 0.0), ("1,000", "1000", 0.0),
    ("1_000", "1000", 0.0), ("nan", "4", 0.0), ("inf", "4", 0.0), ("--4", "-4", 0.0), ("4-", "4", 0.0),
])
def test_numeric_reward(completion, answer, expected):
    assert numeric_reward(completion, answer) == expected


def test_numeric_big_integers_compare_exactly_and_exact_match_strips():
    assert parse_number("12345678901234567890") == 12345678901234567890
    assert numeric_reward("12345678901234567891", "12345678901234567890") == 0.0
    assert exact_reward("  Paris\n", "Paris") == 1.0
    assert exact_reward("paris", "Paris") == 0.0


# ---------------------------------------------------------------- reasoning-gym tasks


@pytest.fixture(scope="module")
def tasks():
    names = ("chain_sum", "basic_arithmetic", "countdown")
    return {name: build_task(TaskConfig(name=name)) for name in names}


@pytest.mark.parametrize("name", ["chain_sum", "basic_arithmetic", "countdown"])
def test_problem_is_deterministic_in_split_and_index(tasks, name):
    again = build_task(TaskConfig(name=name))
    for split in ("train", "eval"):
        assert tasks[name].problems(split, 3, 5) == again.problems(split, 3, 5)
        assert tasks[name].problem(split, 7) == again.problems(split, 0, 8)[7]
    other_seed = build_task(TaskConfig(name=name, seed=1))
    assert [p.prompt for p in other_seed.problems("train", 0, 20)] != [p.prompt for p in again.problems("train", 0, 20)]


@pytest.mark.parametrize("name", ["chain_sum", "countdown"])
def test_train_and_eval_never_share_a_prompt(tasks, name):
    train = [p.prompt for p in tasks[name].problems("train", 0, 400)]
    evals = [p.prompt for p in tasks[name].problems("eval", 0, 40)]
    assert not set(train) & set(evals)
    if name == "chain_sum":
        assert len(set(train)) < len(train)  # the prompt space is small: disjointness is not luck


def test_compact_prompt_formats(tasks):
    chain = tasks["chain_sum"].problem("train", 0)
    assert chain.prompt.endswith("=") and " " not in chain.prompt
    value, _ = evaluate(chain.prompt[:-1])  # an independent check of reasoning-gym's answer
    assert value == int(chain.answer)
    count = tasks["countdown"].problem("train", 0)
    numbers, target = count.prompt[:-1].split(">")
    assert count.prompt.endswith(":") and [int(n) for n in numbers.split(",")] == count.meta["numbers"]
    assert int(target) == count.meta["target"]


@pytest.mark.parametrize("name", ["chain_sum", "basic_arithmetic", "countdown"])
def test_reference_solution_always_scores_one(tasks, name):
    for split in ("train", "eval"):
        for problem in tasks[name].problems(split, 0, 30):
            assert tasks[name].reward(problem, tasks[name].solution(problem)) == 1.0, problem


@pytest.mark.parametrize("name", ["chain_sum", "basic_arithmetic"])
def test_arithmetic_rewards(tasks, name):
    task = tasks[name]
    problem = task.problem("train", 2)
    right = int(problem.answer)
    assert task.reward(problem, str(right)) == 1.0
    assert task.reward(problem, f"{right}.0\n") == 1.0  # numerically equivalent
    assert task.reward(problem, str(right + 1)) == 0.0  # wrong
    for malformed in ("", "abc", f"{right}{right}x", f"{right} {right}"):
        assert task.reward(problem, malformed) == 0.0


def test_countdown_verifier():
    problem = Problem("2,3,9>12:", "2*(9-3)", {"numbers": [2, 3, 9], "target": 12})
    task = GymTask("countdown", {"min_numbers": 3, "max_numbers": 3, "max_value": 9, "min_target": 1})
    assert task.reward(problem, "2*(9-3)") == 1.0
    assert task.reward(problem, " (9 - 3) * 2 ") == 1.0  # another valid expression, spaces allowed
    assert task.reward(problem, "9+3") == 1.0  # each number at most once; not all need be used
    assert task.reward(problem, "9/3*2*2") == 0.0  # reuses 2
    assert task.reward(problem, "3*3+3") == 0.0  # reuses 3
    assert task.reward(problem, "9+2") == 0.0  # misses the target
    assert task.reward(problem, "12") == 0.0  # a number not given
    for hostile in ("__import__('os')", "2**3", "9/(3-3)", "9+3.0", "1_2", "(" * 300 + "12" + ")" * 300, ""):
        assert task.reward(problem, hostile) == 0.0


def test_countdown_fractions_are_exact():
    assert countdown_reward("9/2*2+3", [9, 2, 3], 12) == 0.0  # uses 2 twice
    assert countdown_reward("(9/6)*8", [9, 6, 8], 12) == 1.0  # 1.5 * 8, exact


# ---------------------------------------------------------------- config


def test_config_validation_names_field_and_choices():
    with pytest.raises(ConfigError, match="chain_sum"):
        TaskConfig(name="nope")
    with pytest.raises(ConfigError, match="reasoning_gym"):
        TaskConfig(source="web")
    with pytest.raises(ConfigError, match="max_terms"):
        TaskConfig(min_terms=4, max_terms=2)
    with pytest.raises(ConfigError, match="path"):
        TaskConfig(source="file")
    with pytest.raises(ConfigError, match="operators"):
        TaskConfig(operators="+^")
    with pytest.raises(ConfigError, match="seed"):
        TaskConfig(seed=-1)


def test_config_parses_from_the_command_line():
    import tyro

    cfg = tyro.cli(TaskConfig, args=["--name", "countdown", "--max-target", "50"])
    assert (cfg.name, cfg.max_target, cfg.min_target) == ("countdown", 50, 10)
    assert cfg.gym_options()["max_target"] == 50


def test_default_task_is_small_chain_sum():
    task = build_task(TaskConfig())
    assert isinstance(task, GymTask) and task.name == "chain_sum"
    for problem in task.problems("train", 0, 50):
        operands = problem.prompt[:-1].replace("-", "+").split("+")
        assert 2 <= len(operands) <= 3 and all(len(o) == 1 for o in operands)


# ---------------------------------------------------------------- local files


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def sums(n):
    return [{"question": f"{i}+{i}=", "solution": 2 * i, "extra": "x"} for i in range(n)]


def file_task(path, **kw):
    kw.setdefault("cache_dir", str(path.parent / "hf_cache"))
    return FileTask(str(path), **kw)


def test_jsonl_file_task_loads_splits_and_verifies(tmp_path):
    path = write_jsonl(tmp_path / "sums.jsonl", sums(20))
    task = file_task(path, prompt_column="question", answer_column="solution", eval_fraction=0.25, seed=3)
    assert (task.num_problems("train"), task.num_problems("eval")) == (15, 5)
    train = {p.prompt for p in task.problems("train", 0, 15)}
    evals = {p.prompt for p in task.problems("eval", 0, 5)}
    assert len(train) == 15 and not train & evals and len(train | evals) == 20
    again = file_task(path, prompt_column="question", answer_column="solution", eval_fraction=0.25, seed=3)
    assert again.problems("train", 10, 30) == task.problems("train", 10, 30)
    assert [p.prompt for p in task.problems("train", 15, 15)] != [p.prompt for p in task.problems("train", 0, 15)]
    problem = task.problem("eval", 0)
    i = int(problem.prompt.split("+")[0])
    assert task.reward(problem, f"{2 * i}.0") == 1.0 and task.reward(problem, f"{2 * i + 1}") == 0.0
    assert task.reward(problem, "two") == 0.0 and task.solution(problem) == str(2 * i)


def test_parquet_file_task_with_separate_eval_file_and_exact_match(tmp_path):
    train = pd.DataFrame({"prompt": ["capital of France?", "capital of Italy?"], "answer": ["Paris", "Rome"]})
    evals = pd.DataFrame({"prompt": ["capital of Spain?"], "answer": ["Madrid"]})
    train.to_parquet(tmp_path / "train.parquet")
    evals.to_parquet(tmp_path / "eval.parquet")
    task = file_task(tmp_path / "train.parquet", eval_path=str(tmp_path / "eval.parquet"), match="exact")
    assert task.num_problems("train") == 2 and task.problem("eval", 5).answer == "Madrid"
    problem = task.problem("eval", 0)
    assert task.reward(problem, " Madrid\n") == 1.0 and task.reward(problem, "madrid") == 0.0


def test_build_task_from_file_config(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "1+1=", "answer": "2"}, {"prompt": "2+2=", "answer": "4"}])
    task = build_task(TaskConfig(source="file", path=str(path), cache_dir=str(tmp_path / "c")))
    assert task.name == "file:p.jsonl" and task.num_problems("train") == 1 and task.num_problems("eval") == 1


def test_bad_json_line_names_file_and_line(tmp_path):
    path = tmp_path / "broken.jsonl"
    path.write_text('{"prompt": "1+1=", "answer": "2"}\n\n{"prompt": "2+2=", "answer": \n')
    with pytest.raises(DataError, match=r"broken\.jsonl, line 3: not valid JSON"):
        file_task(path)
    path.write_text('{"prompt": "1+1=", "answer": "2"}\n[1, 2]\n')
    with pytest.raises(DataError, match=r"broken\.jsonl, line 2: expected a JSON object"):
        file_task(path)
    path.write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+2=", "answer": 4}\n')
    with pytest.raises(DataError, match=r"broken\.jsonl, line 2: column 'answer' is a number here but a string"):
        file_task(path)


def test_missing_column_names_file_column_and_columns_present(tmp_path):
    path = write_jsonl(tmp_path / "cols.jsonl", sums(3))
    with pytest.raises(DataError, match=r"cols\.jsonl: no column 'prompt'; columns present: question, solution, "):
        file_task(path)
    pd.DataFrame({"q": ["1+1="], "a": ["2"]}).to_parquet(tmp_path / "cols.parquet")
    with pytest.raises(DataError, match=r"cols\.parquet: no column 'prompt'; columns present: q, a"):
        file_task(tmp_path / "cols.parquet")


def test_empty_files_say_so(tmp_path):
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(DataError, match=r"empty\.jsonl is empty"):
        file_task(tmp_path / "empty.jsonl")
    pd.DataFrame({"prompt": pd.Series([], dtype=str), "answer": pd.Series([], dtype=str)}).to_parquet(
        tmp_path / "empty.parquet")
    with pytest.raises(DataError, match=r"empty\.parquet is empty"):
        file_task(tmp_path / "empty.parquet")
    (tmp_path / "fake.parquet").write_text("not parquet")
    with pytest.raises(DataError, match=r"fake\.parquet: not a readable Parquet file"):
        file_task(tmp_path / "fake.parquet")


def test_unencodable_character_names_file_and_line(tmp_path):
    records = [{"prompt": "1+1=", "answer": "2"}] * 3 + [{"prompt": "π=", "answer": "3"}]
    path = write_jsonl(tmp_path / "accents.jsonl", records)
    with pytest.raises(DataError, match=r"accents\.jsonl, line 4: column 'prompt': character 'π'"):
        file_task(path)
    pd.DataFrame({"prompt": ["a?", "b?"], "answer": ["ok", "né"]}).to_parquet(tmp_path / "accents.parquet")
    with pytest.raises(DataError, match=r"accents\.parquet, row 2: column 'answer': character 'é'"):
        file_task(tmp_path / "accents.parquet", match="exact")


def test_record_level_errors_name_the_line(tmp_path):
    records = [{"prompt": "1+1=", "answer": "2"}, {"prompt": "2+2=", "answer": "four"}]
    path = write_jsonl(tmp_path / "rows.jsonl", records)
    with pytest.raises(DataError, match=r"rows\.jsonl, line 2: answer 'four' is not a number"):
        file_task(path)
    write_jsonl(path, [{"prompt": "1+1=", "answer": "2"}, {"prompt": "", "answer": "0"}])
    with pytest.raises(DataError, match=r"rows\.jsonl, line 2: prompt column 'prompt' is empty"):
        file_task(path)
    path.write_bytes(b'{"prompt": "1+1=", "answer": "2"}\n{"prompt": "\xff", "answer": "2"}\n')
    with pytest.raises(DataError, match=r"rows\.jsonl, line 2: not UTF-8"):
        file_task(path)
    with pytest.raises(DataError, match=r"nothere\.jsonl: file not found"):
        file_task(tmp_path / "nothere.jsonl")
    (tmp_path / "data.csv").write_text("prompt,answer\n")
    with pytest.raises(DataError, match=r"data\.csv: unknown file type '\.csv'"):
        file_task(tmp_path / "data.csv")
