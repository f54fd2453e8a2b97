"""The ``<think>`` and ``<answer>`` tags around a completion's answer, and the stop strings that cut them: a prompt that
opens ``<think>`` (``prompt_opens_think``; its completion is judged after it, ``judged_completion``), and the stops
(``--stop``) that take a tag out of the text they cut, which rollout and eval warn about or refuse (``stop_takes_tag``,
``think_stop``, ``blank_stop``). The answer rules that read past these tags are qerl_cli/answers.py's.

A prompt that ends inside a ``<think>`` it opened (QwQ's and DeepSeek-R1's chat templates end the generation prompt with
``<think>\n``) gets completions without the opening tag: rollout and eval score ``"<think>" + completion``
(``judged_completion``), so every reward judges the turn the model wrote (a draft answer before a ``</think>`` that
never came is no answer; ``format`` finds its opening tag). The stored completion is never changed.
"""

from __future__ import annotations

THINK_OPEN = "<think>"


def prompt_opens_think(prompt_text: str) -> bool:
    """Whether a rendered prompt ends (whitespace aside) with an opening ``<think>``: its completion starts inside
    that block and holds no opening tag of its own. The end only: a ``<think>`` a user message mentions is not one."""
    return prompt_text.rstrip().endswith(THINK_OPEN)


def judged_completion(completion: str, opens_think: bool) -> str:
    """The text rewards judge: the completion, after the ``<think>`` its prompt opened (``prompt_opens_think``)."""
    return THINK_OPEN + completion if opens_think else completion


THINK_CLOSE = "</think>"
# A stop that takes the opening tag cuts a completion's answer inside it away (every rule loses it); one that takes
# only the closing tag leaves the content, where the gsm8k rule reads a tag's number only when closed.
ANSWER_OPEN, ANSWER_CLOSE = "<answer>", "</answer>"


def stop_takes_tag(stop: str, tag: str) -> bool:
    """Whether a stop string takes ``tag`` out of the text it cuts (the text ends where the stop first appears): one
    inside the tag fires at it, if not earlier ("answer" at the word in prose), one holding it (``"</answer>\n"``) cuts
    it wherever it fires, and one that overlaps the tag's start or end with only whitespace beyond it (``"\n<answer"``,
    ``">\n"``) fires at it wherever a completion spaces its tags so (``"</think>\n<answer>"``, R1-style), cutting it
    (missed until 2026-11-28). An overlap with other text beyond (``">>>"``) fires at a tag only where a completion
    writes that text beside it, so it is left alone."""
    if stop in tag or tag in stop:
        return True
    return any((stop.endswith(tag[:k]) and not stop[:-k].strip()) or (stop.startswith(tag[-k:]) and not stop[k:].strip())
               for k in range(1, len(tag)))


def stop_taking(stops, tags) -> tuple[str, str] | None:
    """(the first of ``stops`` that takes one of ``tags`` out of the text it cuts, that tag), or None."""
    return next(((x, t) for x in stops for t in tags if stop_takes_tag(x, t)), None)


def every_stopped(stop: str, tag: str, noun: str = "completion") -> str:
    """Which completions a stop that takes ``tag`` costs it: every one where the stop lies inside the tag (it fires
    there if not earlier), else every one it stops (one holding or overlapping the tag may fire elsewhere only)."""
    return f"every {noun}" if stop in tag else f"every {noun} it stops"


def think_stop(stops, prompts) -> tuple[str, str, object | None] | None:
    """A stop that leaves the answer rules (gsm8k and math read nothing after a ``<think>`` left open) nothing to read
    in the text it cuts, as (stop, tag, prompt), the prompts rendered (``EncodedPrompt.opens_think``):

    - (stop, ``</think>``, a prompt that opens ``<think>``): every completion of it is judged inside it, all 0;
    - (stop, ``</think>``, None): no prompt opens one, so only a completion that opens its own is left inside it;
    - (stop, ``<think>``, a prompt that does not open it): a completion of it that opens its own ``<think>`` is cut
      there, before its answer (a prompt that opens it has completions without the tag: harmless).

    None: no such stop. One stop that takes both tags (``"think>"``) is judged by ``</think>`` (one finding, the
    graver)."""
    closing = stop_taking(stops, (THINK_CLOSE,))
    if closing is not None:
        return (*closing, next((p for p in prompts if p.opens_think), None))
    opening = stop_taking(stops, (THINK_OPEN,))
    unopened = next((p for p in prompts if not p.opens_think), None)
    return (*opening, unopened) if opening is not None and unopened is not None else None


def blank_stop(stops, prompts) -> tuple[str, object] | None:
    """A stop made only of whitespace (``$'\\n\\n'``, ``$'\\n'``: a base model's few-shot stop) and a prompt that
    opens ``<think>`` (``EncodedPrompt.opens_think``), as (stop, prompt), or None. Such a stop fires at the first
    line break or blank line of a completion of that prompt, which lies in its thought, so the text judged is left
    inside the ``<think>``, where the answer rules read nothing and the format reward finds no ``</think>``: a score
    of 0 (unsaid until 2026-11-28). A thought without such a break escapes it, so the score can be nonzero: a
    warning, not a refusal. Where no prompt opens ``<think>``, a completion that writes none is not cut in one."""
    x = next((x for x in stops if not x.strip()), None)
    prompt = next((p for p in prompts if p.opens_think), None) if x is not None else None
    return (x, prompt) if prompt is not None else None
