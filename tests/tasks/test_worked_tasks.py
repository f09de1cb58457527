"""Long-completion tasks (moe_rl/tasks/worked.py): worked solutions verify; wrong, truncated and malformed
completions score 0; the verifier only parses; splits are disjoint and deterministic."""

from __future__ import annotations

import builtins

import pytest

from moe_rl.errors import ConfigError
from moe_rl.tasks import RunningSumTask, TaskConfig, build_task
from moe_rl.tasks.worked import parse_steps, worked_solution


@pytest.fixture(scope="module")
def task():
    return build_task(TaskConfig(name="running_sum", min_terms=4, max_terms=6))


def test_worked_solution_is_the_left_to_right_chain():
    assert worked_solution([3, 4, 2, 9], ["+", "-", "+"]) == ("3+4=7;7-2=5;5+9=14", 14)
    assert worked_solution([1, 5, 2], ["-", "-"]) == ("1-5=-4;-4-2=-6", -6)


def test_every_reference_solution_verifies_and_has_long_completions(task):
    problems = task.problems("train", 0, 300)
    assert all(task.reward(p, task.solution(p)) == 1.0 for p in problems)
    lengths = [len(task.solution(p)) for p in problems]
    assert 20 <= sum(lengths) / len(lengths) <= 35 and min(lengths) >= 14 and max(lengths) <= 80
    assert all(p.prompt.endswith("=") and 4 <= len(p.meta["terms"]) <= 6 for p in problems)


def test_wrong_truncated_and_malformed_completions_score_zero(task):
    p = next(q for q in task.problems("eval", 0, 50) if len(q.meta["ops"]) == 3)
    good = task.solution(p)
    steps = good.split(";")
    final = int(p.answer)
    wrong_final = ";".join(steps[:-1] + [steps[-1].rsplit("=", 1)[0] + f"={final + 1}"])
    bad = [
        wrong_final,                    # right chain, wrong answer
        good[:-1],                      # truncated inside the last number ("...=14" -> "...=1") or its sign
        ";".join(steps[:-1]),           # truncated before the last step
        good + ";",                     # empty trailing step
        good + "x", good + "=" + p.answer,  # trailing junk, an extra "="
        good.replace(";", ","),         # wrong separator
        "", "   ", p.answer,            # no chain at all: the bare answer is not a worked solution
        good.replace("=", "==", 1),     # malformed step
        good + ";" + steps[-1],         # one step too many
    ]
    assert task.reward(p, good) == 1.0 and task.reward(p, f"  {good}\n") == 1.0
    for completion in bad:
        assert task.reward(p, completion) == 0.0, completion


def test_only_the_final_answer_is_rewarded_unless_check_steps(task):
    p = next(q for q in task.problems("train", 0, 50) if len(q.meta["ops"]) == 3)
    wrong_middle = "1+1=2;2+2=4;4+4=" + p.answer  # well formed, right length, right final answer
    assert task.reward(p, wrong_middle) == 1.0
    strict = build_task(TaskConfig(name="running_sum", min_terms=4, max_terms=6, check_steps=True))
    q = strict.problem("train", p.meta["index"])
    assert strict.reward(q, wrong_middle) == 0.0 and strict.reward(q, strict.solution(q)) == 1.0


def test_parse_steps_reads_and_never_executes(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the verifier must not execute text")

    monkeypatch.setattr(builtins, "eval", refuse)
    monkeypatch.setattr(builtins, "exec", refuse)
    assert parse_steps("3+4=7;7-12=-5") == [(3, "+", 4, 7), (7, "-", 12, -5)]
    for text in ("__import__('os').system('x')=1", "3+4=7;", "3*4=12", "3+4=7 ;7-2=5", "9" * 600):
        assert parse_steps(text) is None


def test_splits_are_disjoint_deterministic_and_seeded(task):
    train = {p.prompt for p in task.problems("train", 0, 2000)}
    evals = [p.prompt for p in task.problems("eval", 0, 300)]
    assert not train & set(evals)
    again = build_task(TaskConfig(name="running_sum", min_terms=4, max_terms=6))
    assert [p.prompt for p in again.problems("eval", 0, 300)] == evals
    other = build_task(TaskConfig(name="running_sum", min_terms=4, max_terms=6, seed=1))
    assert [p.prompt for p in other.problems("train", 0, 20)] != [p.prompt for p in task.problems("train", 0, 20)]


def test_bad_knobs_are_refused():
    with pytest.raises(ConfigError, match="min_terms"):
        TaskConfig(name="running_sum", min_terms=1)
    with pytest.raises(ConfigError, match="running_sum"):
        RunningSumTask(min_terms=3, max_terms=2)


def test_a_noisy_demonstrator_slips_at_its_rate_and_never_touches_rewards():
    clean = RunningSumTask(min_terms=4, max_terms=6)
    noisy = RunningSumTask(min_terms=4, max_terms=6, demo_slip_rate=0.15)
    problems = noisy.problems("train", 0, 1000)
    demos = [noisy.solution(p) for p in problems]
    assert demos == [noisy.solution(p) for p in problems]  # deterministic per problem
    wrong = [p for p, d in zip(problems, demos) if noisy.reward(p, d) == 0.0]
    # each of the 3-5 steps slips with probability 0.15: about 1 - 0.85^4 = 0.48 of demonstrations end wrong
    assert 0.38 < len(wrong) / len(problems) < 0.55
    for p, d in zip(problems, demos):
        steps = parse_steps(d)
        assert steps is not None and len(steps) == len(p.meta["ops"])  # well-formed chains, only results slip
        assert all(0 < abs(r - (a + t if op == "+" else a - t)) <= 2 or r == (a + t if op == "+" else a - t)
                   for a, op, t, r in steps)
        assert clean.reward(p, p.meta["solution"]) == noisy.reward(p, p.meta["solution"]) == 1.0
    assert [clean.solution(p) for p in problems] == [p.meta["solution"] for p in problems]
    with pytest.raises(ConfigError, match="demo_slip_rate"):
        RunningSumTask(demo_slip_rate=1.0)
