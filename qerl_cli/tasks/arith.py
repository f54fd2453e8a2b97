"""The embedded synthetic reasoning task: short multi-step arithmetic word problems.

A problem is generated deterministically from a seed::

    Q: Mia has 17 pens. Mia buys 5 more. Mia loses 3. How many pens does Mia have?
    A:

and its worked solution (the completion a model should write) is one equation per step, then
the final answer after ``####``::

     17+5=22. 22-3=19. #### 19

Every quantity is a non-negative integer below 100, every operand of a step is one digit, so
a ~1M-parameter model can learn the arithmetic; what it must also learn is which verbs add
and which subtract.

Pretraining corpus vs. task
---------------------------
``worked_solution(problem, rng, confusion=...)`` can write *corrupted* solutions: for a verb
with confusion rate c, a step with that verb is written with the wrong operation with
probability c (the arithmetic of the wrong step is still exact, and the chain continues from
the wrong total). The bundled tiny model is pretrained on such a mix (``PRETRAIN_CONFUSION``),
so it knows the format and the arithmetic but holds a wrong belief about a few verbs; greedy
decoding then fails on problems that use them, while sampling at temperature 1 still finds the
right chain often. That is the headroom RL with a verifiable reward can use. The task files
(train/test prompts and reference answers) are always correct.

The answer of any prompt can be recomputed from its text alone: ``solve(prompt)``.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

NAMES = ("Tom", "Ann", "Sam", "Mia", "Ben", "Eva", "Max", "Zoe", "Leo", "Ivy")
ITEMS = ("apples", "pens", "coins", "cards", "books", "shells", "cups", "eggs")
# verb phrase (with {n}) -> sign of the step
VERBS: dict[str, int] = {
    "buys {n} more": +1,
    "finds {n} more": +1,
    "gets {n} more": +1,
    "wins {n} more": +1,
    "makes {n} more": +1,
    "gives away {n}": -1,
    "sells {n}": -1,
    "loses {n}": -1,
    "uses {n}": -1,
    "drops {n}": -1,
}
ADD_VERBS = tuple(v for v, s in VERBS.items() if s > 0)
SUB_VERBS = tuple(v for v, s in VERBS.items() if s < 0)

# Confusion rates of the pretraining corpus (probability that a step with this verb is written
# with the wrong operation). Three subtraction verbs are mostly wrong in the corpus, one is
# sometimes wrong; the addition verbs are always right.
PRETRAIN_CONFUSION: dict[str, float] = {
    "sells {n}": 0.35,
    "loses {n}": 0.6,
    "uses {n}": 0.65,
    "drops {n}": 0.7,
}

ANSWER_RE = re.compile(r"####\s*(-?\d+)")
PROMPT_PREFIX = "Q: "
PROMPT_SUFFIX = "\nA:"


@dataclass(frozen=True)
class Problem:
    name: str
    item: str
    start: int
    steps: tuple[tuple[str, int], ...]  # (verb phrase template, operand)

    @property
    def answer(self) -> int:
        total = self.start
        for verb, n in self.steps:
            total += VERBS[verb] * n
        return total

    @property
    def prompt(self) -> str:
        parts = [f"{self.name} has {self.start} {self.item}."]
        parts += [f"{self.name} {verb.format(n=n)}." for verb, n in self.steps]
        parts.append(f"How many {self.item} does {self.name} have?")
        return PROMPT_PREFIX + " ".join(parts) + PROMPT_SUFFIX


@dataclass(frozen=True)
class TaskSpec:
    """Difficulty knobs of the generator (the bundled files use the defaults)."""

    min_steps: int = 2
    max_steps: int = 3
    min_start: int = 5
    max_start: int = 30
    max_operand: int = 9
    p_sub: float = 0.5  # probability a step is a subtraction (when the total allows one)


DEFAULT_SPEC = TaskSpec()


def sample_problem(rng: random.Random, spec: TaskSpec = DEFAULT_SPEC) -> Problem:
    name = rng.choice(NAMES)
    item = rng.choice(ITEMS)
    start = rng.randint(spec.min_start, spec.max_start)
    k = rng.randint(spec.min_steps, spec.max_steps)
    total = start
    steps = []
    for _ in range(k):
        n = rng.randint(1, spec.max_operand)
        if rng.random() < spec.p_sub and n <= total:
            verb = rng.choice(SUB_VERBS)
            total -= n
        else:
            verb = rng.choice(ADD_VERBS)
            total += n
        steps.append((verb, n))
    return Problem(name, item, start, tuple(steps))


def generate(seed: int, count: int, spec: TaskSpec = DEFAULT_SPEC, exclude: set[str] | None = None) -> list[Problem]:
    """``count`` distinct problems from ``seed`` (same seed, same list), skipping prompts in ``exclude``."""
    rng = random.Random(seed)
    seen = set(exclude or ())
    out: list[Problem] = []
    while len(out) < count:
        p = sample_problem(rng, spec)
        if p.prompt in seen:
            continue
        seen.add(p.prompt)
        out.append(p)
    return out


def iter_problems(seed: int, spec: TaskSpec = DEFAULT_SPEC) -> Iterator[Problem]:
    """An endless deterministic stream of problems (repeats possible), for pretraining."""
    rng = random.Random(seed)
    while True:
        yield sample_problem(rng, spec)


def worked_solution(
    problem: Problem, rng: random.Random | None = None, confusion: Mapping[str, float] | None = None
) -> str:
    """The completion text: ``" a+b=c. c-d=e. #### e"``.

    With ``confusion`` (verb -> rate) and ``rng``, each step of a listed verb uses the wrong
    operation with that probability (never producing a negative total); the final answer is
    then that of the written chain, i.e. wrong.
    """
    total = problem.start
    eqs = []
    for verb, n in problem.steps:
        sign = VERBS[verb]
        if confusion and rng is not None and rng.random() < confusion.get(verb, 0.0):
            if total + -sign * n >= 0:
                sign = -sign
        new = total + sign * n
        eqs.append(f"{total}{'+' if sign > 0 else '-'}{n}={new}.")
        total = new
    return " " + " ".join(eqs) + f" #### {total}"


def extract_answer(text: str) -> str | None:
    """The number after the first ``####`` in ``text`` (the task's answer rule), else None."""
    m = ANSWER_RE.search(text)
    return m.group(1) if m else None


def is_correct(completion: str, answer: str | int) -> bool:
    got = extract_answer(completion)
    return got is not None and int(got) == int(answer)


_SENT_RE = re.compile(r"([A-Z][a-z]+) has (\d+) ([a-z]+)\.")


def parse_prompt(prompt: str) -> Problem:
    """Rebuild the ``Problem`` from a prompt's text (inverse of ``Problem.prompt``)."""
    body = prompt.removeprefix(PROMPT_PREFIX).removesuffix(PROMPT_SUFFIX)
    m = _SENT_RE.match(body)
    if not m:
        raise ValueError(f"not a task prompt: {prompt!r}")
    name, start, item = m.group(1), int(m.group(2)), m.group(3)
    rest = body[m.end():].strip()
    tail = f"How many {item} does {name} have?"
    if not rest.endswith(tail):
        raise ValueError(f"not a task prompt (question): {prompt!r}")
    rest = rest[: -len(tail)].strip()
    steps = []
    patterns = [(v, re.compile(re.escape(v).replace(r"\{n\}", r"(\d+)"))) for v in VERBS]
    for sent in filter(None, (s.strip() for s in rest.split("."))):
        if not sent.startswith(name + " "):
            raise ValueError(f"bad step {sent!r} in {prompt!r}")
        phrase = sent[len(name) + 1:]
        for v, pat in patterns:
            pm = pat.fullmatch(phrase)
            if pm:
                steps.append((v, int(pm.group(1))))
                break
        else:
            raise ValueError(f"unknown step {sent!r} in {prompt!r}")
    return Problem(name, item, start, tuple(steps))


def solve(prompt: str) -> int:
    """The correct answer of a task prompt, recomputed from its text."""
    return parse_prompt(prompt).answer


# ---- task files --------------------------------------------------------------------------
TRAIN_SEED = 1234
TEST_SEED = 5678
TRAIN_SIZE = 2000
TEST_SIZE = 200


def task_rows(split: str) -> list[dict]:
    """The rows of the bundled task split (``train`` | ``test``), regenerated from the seeds.

    Test problems are generated first; train problems never repeat a test prompt.
    """
    test = generate(TEST_SEED, TEST_SIZE)
    if split == "test":
        probs = test
    elif split == "train":
        probs = generate(TRAIN_SEED, TRAIN_SIZE, exclude={p.prompt for p in test})
    else:
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    return [{"prompt": p.prompt, "answer": str(p.answer)} for p in probs]


def write_task_files(out_dir: Path) -> dict[str, Path]:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {}
    for split in ("train", "test"):
        path = out_dir / f"{split}.jsonl"
        with open(path, "w") as f:
            for row in task_rows(split):
                f.write(json.dumps(row) + "\n")
        paths[split] = path
    return paths
