"""Where training prompts come from: text that ships inside redistributable packages, the target's own
prompts, and files a user names. Each prompt keeps its source and licence, for the head's card.

Benchmark text (Spec-Bench, MT-Bench) is never a source: the benchmarks must stay unseen.

- `packages`: paragraphs of the descriptions of the installed Python distributions under a permissive
  licence (their METADATA, as the registry serves it), each wrapped in an instruction (summarise, extract,
  explain, translate, rewrite, ask about it).
- `python`: small functions of the Python standard library (PSF-2.0), to explain, review or rewrite.
- `self`: prompts the target writes itself, sampled from a user turn of its chat template (written later,
  by the target: see `train.py`). Left to itself, SmolLM2 writes mostly requests for advice (of 3,994: 25%
  about business, marketing or careers, 27% opening "Can you", under 1% puzzles), far from what users ask
  of a general assistant, and a head learns the text it is trained on. So two turns in three start with one
  of SELF_PROMPT_OPENERS, a few words of a kind of task (written here, from no benchmark), and the target
  writes the rest; the third starts empty.
- `--prompts FILE`: one prompt per line, or JSON lines with a "prompt" field.
"""

from dataclasses import dataclass
import importlib
import importlib.metadata
import inspect
import json
import pathlib
import random
import re

SOURCES = ("packages", "python", "self")
PERMISSIVE = re.compile(r"\b(MIT|BSD|Apache|PSF|Python Software Foundation|ISC|0BSD|Unlicense|CC0)", re.I)
PACKAGE_TASKS = (
    "Summarize the following text in two or three sentences.\n\n{text}",
    "Extract the key facts from this text as a bulleted list.\n\n{text}",
    "Explain this to someone who has never programmed:\n\n{text}",
    "Translate the following paragraph into French.\n\n{text}",
    "Rewrite this text to be clearer and shorter.\n\n{text}",
    "Read the text and answer: what problem does it solve, and for whom?\n\n{text}",
    "Write three questions a student could ask about this text, then answer them.\n\n{text}",
    "Write a short story in which a character uses what this text describes.\n\n{text}",
)
CODE_TASKS = (
    "Explain what this Python function does, step by step.\n\n```python\n{text}\n```",
    "Review this Python code: what could go wrong, and how would you improve it?\n\n```python\n{text}\n```",
    "Write unit tests for this Python function.\n\n```python\n{text}\n```",
    "Rewrite this Python function in JavaScript.\n\n```python\n{text}\n```",
)
TASKS_PER_PARAGRAPH = 2
# The first words of self-written prompts (module docstring): kinds of tasks a general assistant gets.
SELF_PROMPT_OPENERS = (
    "Write a poem about",
    "Write a short story",
    "Write a letter",
    "Write an essay on",
    "Write a speech",
    "Compose a",
    "Draft an email",
    "Describe",
    "Imagine you are",
    "Pretend to be",
    "You are a",
    "Act as",
    "Solve",
    "Calculate",
    "What is the value of",
    "Find the",
    "How many",
    "If a train",
    "Prove that",
    "A farmer has",
    "Explain why",
    "Explain how",
    "Explain the concept of",
    "What causes",
    "Why do",
    "How does",
    "What is the difference between",
    "Compare",
    "What were the main causes of",
    "Who was",
    "What is the history of",
    "Discuss",
    "Analyze",
    "Summarize",
    "Extract",
    "List",
    "Classify",
    "Rewrite",
    "Translate",
    "Edit",
    "Write a Python function",
    "Write a function in",
    "Implement",
    "Debug this code",
    "Write a SQL query",
    "What does this code do",
    "Give me",
    "Suggest",
    "Help me plan",
    "What are the pros and cons of",
    "Is it true that",
    "Which is",
    "Tell me about",
    "Create a",
    "Design a",
    "Brainstorm",
    "In three sentences,",
    "Step by step,",
)
SELF_PROMPT_EMPTY_SHARE = 1 / 3  # turns that start empty: the target's own kind of request
STDLIB_MODULES = (
    "textwrap",
    "heapq",
    "bisect",
    "statistics",
    "fractions",
    "colorsys",
    "calendar",
    "shlex",
    "difflib",
    "string",
    "glob",
    "fnmatch",
    "posixpath",
    "base64",
    "quopri",
    "html",
    "ipaddress",
    "random",
    "datetime",
    "json.encoder",
    "json.decoder",
    "csv",
    "urllib.parse",
    "gettext",
    "locale",
    "operator",
    "functools",
    "tokenize",
    "graphlib",
    "pprint",
    "email.utils",
    "copy",
)


@dataclass(frozen=True)
class Prompt:
    text: str
    source: str  # "packages:<distribution>", "python:<module>", "self", "file:<path>"
    licence: str


class PromptSourceError(ValueError):
    """A prompt source that cannot be read or gives nothing; the message names it."""


def package_prompts(rng: random.Random) -> list[Prompt]:
    """Instructions over prose paragraphs of permissively licensed installed distributions' descriptions."""
    prompts = []
    for dist in sorted(importlib.metadata.distributions(), key=lambda d: d.metadata["Name"] or ""):
        licence = _licence(dist.metadata)
        if not licence or not PERMISSIVE.search(licence):
            continue
        for paragraph in _prose_paragraphs(dist.metadata.get_payload() or dist.metadata.get("Description") or ""):
            for task in rng.sample(PACKAGE_TASKS, TASKS_PER_PARAGRAPH):
                prompts.append(Prompt(task.format(text=paragraph), f"packages:{dist.metadata['Name']}", licence))
    return prompts


def _licence(metadata) -> str:
    classifiers = [c.split(" :: ")[-1] for c in metadata.get_all("Classifier") or [] if c.startswith("License ::")]
    return (
        metadata.get("License-Expression")
        or (classifiers[0] if classifiers else "")
        or (metadata.get("License") or "").split("\n")[0][:80]
    )


def _prose_paragraphs(description: str) -> list[str]:
    paragraphs = []
    for paragraph in re.split(r"\n\s*\n", description):
        text = " ".join(paragraph.split())
        letters = sum(ch.isalpha() or ch.isspace() for ch in text)
        if 200 <= len(text) <= 1200 and letters >= 0.9 * len(text) and "http" not in text and "```" not in text:
            paragraphs.append(text)
    return paragraphs


def self_prompt_openers(num_prompts: int, seed: int) -> list[str]:
    """How each of `num_prompts` self-written prompts starts: "" (as the target likes) about
    SELF_PROMPT_EMPTY_SHARE of them, the others one of SELF_PROMPT_OPENERS; the same for the same seed."""
    rng = random.Random(seed)
    return [
        "" if rng.random() < SELF_PROMPT_EMPTY_SHARE else rng.choice(SELF_PROMPT_OPENERS) for _ in range(num_prompts)
    ]


def python_prompts(rng: random.Random) -> list[Prompt]:
    """Tasks over small functions of the standard library (PSF-2.0)."""
    prompts = []
    for name in STDLIB_MODULES:
        module = importlib.import_module(name)
        for _, function in sorted(inspect.getmembers(module, inspect.isfunction)):
            if function.__module__ != module.__name__:
                continue
            try:
                source = inspect.getsource(function)
            except (OSError, TypeError):
                continue
            if 200 <= len(source) <= 1500:
                prompts.append(Prompt(rng.choice(CODE_TASKS).format(text=source.rstrip()), f"python:{name}", "PSF-2.0"))
    return prompts


def file_prompts(path: str) -> list[Prompt]:
    """One prompt per line, or JSON lines with a "prompt" field; PromptSourceError names a bad file."""
    try:
        lines = pathlib.Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise PromptSourceError(f"cannot read prompts from {path}: {exc}") from exc
    prompts = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        text = line
        if line.lstrip().startswith("{"):
            try:
                text = json.loads(line)["prompt"]
            except (json.JSONDecodeError, KeyError, TypeError) as exc:
                raise PromptSourceError(f'{path}:{number}: a JSON line needs a "prompt" string') from exc
        prompts.append(Prompt(str(text), f"file:{path}", "as its owner states"))
    if not prompts:
        raise PromptSourceError(f"{path}: no prompts in it")
    return prompts


def collect(sources: list[str], files: list[str], num_prompts: int, seed: int) -> list[Prompt]:
    """Up to `num_prompts` prompts from the fixed sources and files, shuffled with `seed` (`self` prompts are
    made later). Files are read whole; the packaged sources are sampled."""
    rng = random.Random(seed)
    prompts = [p for path in files for p in file_prompts(path)]
    if "packages" in sources:
        prompts += package_prompts(rng)
    if "python" in sources:
        prompts += python_prompts(rng)
    rng.shuffle(prompts)
    return prompts[:num_prompts]


def licences(prompts: list[Prompt]) -> dict[str, dict]:
    """Per source: its licence and how many prompts came from it (for the head's card)."""
    summary: dict[str, dict] = {}
    for prompt in prompts:
        entry = summary.setdefault(prompt.source, {"licence": prompt.licence, "num_prompts": 0})
        entry["num_prompts"] += 1
    return dict(sorted(summary.items()))
