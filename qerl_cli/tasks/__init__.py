"""Deterministic synthetic tasks that qerl generates itself (no downloads)."""

from qerl_cli.tasks.arith import (
    ANSWER_RE,
    PRETRAIN_CONFUSION,
    Problem,
    TaskSpec,
    extract_answer,
    generate,
    is_correct,
    iter_problems,
    parse_prompt,
    solve,
    task_rows,
    worked_solution,
    write_task_files,
)

__all__ = [
    "ANSWER_RE",
    "PRETRAIN_CONFUSION",
    "Problem",
    "TaskSpec",
    "extract_answer",
    "generate",
    "is_correct",
    "iter_problems",
    "parse_prompt",
    "solve",
    "task_rows",
    "worked_solution",
    "write_task_files",
]
