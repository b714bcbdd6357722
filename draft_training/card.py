"""The head's model card (README.md next to its weights), written from the run's summary."""

import platform

_LABELS = {False: "the target's token", True: "the target's distribution over the draft vocabulary (soft)"}


def render(summary: dict) -> str:
    """Markdown: what the head is for, the command, its data and their licences, time, held-out accuracy."""
    config = summary["config"]
    accuracy = summary["held_out_accuracy_by_position"]
    minutes = summary["minutes"]
    lines = [
        f"# EAGLE-3 draft head for {summary['target_name']}",
        "",
        f"Trained by `specdec train-draft` for the target `{summary['target_name']}` "
        f"(dtype {config['dtype']}); serve it with `specdec serve --proposer eagle3 --draft-model THIS_DIR`.",
        "",
        "## How it was made",
        "",
        "```bash",
        summary.get("command", "specdec train-draft"),
        "```",
        "",
        f"- Machine: {summary.get('machine', platform.processor() or platform.machine())}, "
        f"{summary.get('num_threads') or 'all'} threads.",
        f"- Time: prompts {minutes.get('prompts_min', 0):.1f} min, target responses "
        f"{minutes.get('responses_min', 0):.1f} min, training {minutes.get('train_min', 0):.1f} min.",
        f"- Data: {summary['num_conversations']} conversations, {summary['num_train_tokens']} training tokens "
        f"({summary['num_response_tokens']} response tokens written by the target, greedy, at most "
        f"{config['max_new_tokens']} each); labels: {_LABELS[bool(config.get('soft_labels'))]}; "
        f"{config['epochs']} epochs, {config['num_steps']} unrolled draft steps, "
        f"learning rate {config['learning_rate']}, seed {config['seed']}, "
        f"training precision {summary.get('train_precision', 'float32')}.",
        f"- Draft vocabulary: {summary['draft_vocab_size']} tokens, covering "
        f"{summary['draft_vocab_coverage']:.1%} of the response tokens.",
        "",
        "Held-out accuracy by draft position (how often draft j is the target's token, the drafts before it "
        "being right):",
        "",
        "| position | " + " | ".join(str(j + 1) for j in range(len(accuracy))) + " |",
        "|---|" + "---|" * len(accuracy),
        "| accuracy | " + " | ".join(f"{a:.3f}" for a in accuracy) + " |",
        "",
        "## Data sources and licences",
        "",
        "Prompts only; every response is the target's own. No benchmark text (Spec-Bench, MT-Bench) was used.",
        "",
        "| source | licence | prompts |",
        "|---|---|---|",
    ]
    lines += [
        f"| {source} | {entry['licence']} | {entry['num_prompts']} |" for source, entry in summary["sources"].items()
    ]
    return "\n".join(lines) + "\n"
