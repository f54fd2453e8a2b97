"""Precision and recall of the math answer rule on a labelled set, beside math-verify's own extraction.

    python benchmarks/compare_math_rule.py             # counts
    python benchmarks/compare_math_rule.py --show      # and each case either judge gets wrong
    python benchmarks/compare_math_rule.py --baseline 52f146d   # and the rule at that revision (math 1 there)

The set (tests/data/math_rule_cases.jsonl, which tests/test_math_rule.py also runs) holds MATH-500-style references
(fractions, roots, intervals, sets, tuples, matrices, choices, text, units, degrees, percents, equations, big
numbers) with the answers models box for them, right and wrong, and the verdict a careful grader gives
(``correct``; ``reason``, where given, says why); ``known_miss`` says why the rule still gets a case wrong. A positive is a right answer: precision is
the share of the answers scored right that are, recall the share of the right answers scored right. math-verify's
column is its documented use, ``verify(parse("$" + reference + "$"), parse(completion))`` with default configs.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
CASES = ROOT / "tests" / "data" / "math_rule_cases.jsonl"


def _math_verify(reference: str, completion: str) -> bool:
    from math_verify import parse, verify

    gold = parse(reference if "\\boxed" in reference else f"${reference}$")
    return bool(verify(gold, parse(completion)))


def _qerl(reference: str, completion: str) -> bool:
    from qerl_cli.answers import is_correct

    return is_correct(completion, reference, "math")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--show", action="store_true", help="print each case a judge gets wrong")
    ap.add_argument("--baseline", help="also judge with the rule at this git revision (e.g. 52f146d: math 1)")
    args = ap.parse_args()
    logging.disable(logging.CRITICAL)  # math-verify's parse failures
    cases = [json.loads(line) for line in CASES.read_text().splitlines()]
    print(f"{len(cases)} cases, {sum(c['correct'] for c in cases)} right answers")
    judges = [("qerl math rule", _qerl), ("math-verify defaults", _math_verify)]
    if args.baseline:
        from compare_gsm8k_rule import load_answers

        old = load_answers(args.baseline)
        judges.insert(1, (f"rule at {args.baseline[:10]}", lambda ref, text: old.is_correct(text, ref, "math")))
    for name, judge in judges:
        tp = fp = fn = 0
        for c in cases:
            got = judge(c["reference"], c["completion"])
            tp += got and c["correct"]
            fp += got and not c["correct"]
            fn += not got and c["correct"]
            if args.show and got != c["correct"]:
                print(f"  {name}: {'wrongly right' if got else 'missed'}: {c['reference']!r} <- {c['completion']!r}")
        print(f"{name:22s} precision {tp / max(tp + fp, 1):.3f} ({fp} wrong answers taken), "
              f"recall {tp / max(tp + fn, 1):.3f} ({fn} right answers missed)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
