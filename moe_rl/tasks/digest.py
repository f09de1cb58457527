"""What a run's task data is, as a content hash, so that a resume can tell when it would continue on other data.

    task_digest(cfg, task) -> {"task.path": {"what": "task.path data/train.jsonl", "sha256": ...}, ...}

A file task is the bytes of its files (`path`, and `eval_path` when set); a generated task is its generator's
config plus the problems it makes (the first `probe` of each split), so a new reasoning-gym version that generates
other problems from the same config is noticed too.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict
from typing import Any

from moe_rl.runs.digest import file_sha256
from moe_rl.tasks.base import Task
from moe_rl.tasks.config import TaskConfig


def task_digest(cfg: TaskConfig, task: Task, probe: int = 64) -> dict[str, dict[str, Any]]:
    """{input name: {"what": how a message names it, "sha256": its content hash}} (manifest.json `inputs`)."""
    if cfg.source == "file":
        return {f"task.{name}": {"what": f"task.{name} {getattr(cfg, name)}", "sha256": file_sha256(getattr(cfg, name))}
                for name in ("path", "eval_path") if getattr(cfg, name)}
    # train and eval only: the data a run trains and reports on (validation came later; old digests stay valid)
    problems = [[p.prompt, p.answer] for split in ("train", "eval") for p in task.problems(split, 0, probe)]
    content = json.dumps({"config": asdict(cfg), "problems": problems}, sort_keys=True)
    return {"task": {"what": f"the {cfg.name} generator's problems",
                     "sha256": hashlib.sha256(content.encode("utf-8")).hexdigest()}}
