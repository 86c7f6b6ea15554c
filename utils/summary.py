"""End-of-run summary: a table, ``summary.json`` and ``training_curves.png`` from each step's metrics.

Every step's :class:`~utils.logger.TrainLogger` writes ``<output_dir>/metrics.jsonl``,
one JSON object a line: ``{"step": 12, "phase": "train" | "eval", "time": ..., <values>}``.
This module reads those files (tolerating missing keys, files and non-numeric
values), condenses them per step and draws the curves with matplotlib (Agg).

* step 1 (SFT): eval ``perplexity`` / ``loss``, train ``loss``
* step 2 (reward model): eval ``acc`` (+ chosen / rejected mean scores), train ``loss``
* step 3 (PPO, or the run's algorithm: GRPO …): train ``reward``, ``kl``, ``actor_loss``, ``critic_loss``

A run on built-in data also has a held-out check (:mod:`utils.heldout`): rule scores
of the step-1 and step-3 actors' greedy answers and the reward model's accuracy per
rejected kind. It goes under ``"heldout"`` in ``summary.json``, below the table and
into the curves' last column.
"""
from __future__ import annotations

import datetime
import json
import math
import os

from utils.files import writing

# Accepted spellings of each quantity (the first one found in a row wins).
ALIASES = {
    "loss": ("loss", "train_loss"),
    "perplexity": ("perplexity", "ppl"),
    "acc": ("acc", "accuracy", "reward_accuracy"),
    "chosen": ("chosen", "chosen_score", "chosen_mean_score", "chosen_reward"),
    "rejected": ("rejected", "rejected_score", "rejected_mean_score", "rejected_reward"),
    "reward": ("reward", "average_reward", "avg_reward", "reward_score"),
    "kl": ("kl", "approx_kl", "kl_div", "kl_divergence"),
    "actor_loss": ("actor_loss", "act_loss"),
    "critic_loss": ("critic_loss", "cri_loss"),
}
STEP_NAMES = {1: "1 SFT (actor)", 2: "2 reward model", 3: "3 {algorithm} (RLHF)"}
DEFAULT_ALGORITHM = "PPO"  # step 3's name when the caller does not say (train.py says: step3_title)


def read_metrics(path: str) -> list:
    """The rows of a ``metrics.jsonl`` ([] when absent); unreadable lines are skipped."""
    rows = []
    if not os.path.isfile(path):
        return rows
    with open(path) as f:
        for line in f:
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(row, dict):
                rows.append(row)
    return rows


def _number(value):
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None


def series(rows: list, phase: str, quantity: str) -> tuple[list, list]:
    """(steps, values) of ``quantity`` (any alias) in rows of ``phase``; rows without it are skipped."""
    xs, ys = [], []
    for row in rows:
        if row.get("phase") != phase:
            continue
        for key in ALIASES.get(quantity, (quantity,)):
            value = _number(row.get(key))
            if value is not None:
                xs.append(row.get("step", len(xs)))
                ys.append(value)
                break
    return xs, ys


REWARD_WINDOW = 10  # step 3's reward start/end: means of the first/last min(10, a quarter) steps


def head_tail_window(count: int) -> int:
    """How many of ``count`` noisy values the start/end means take: a quarter, 1 to ``REWARD_WINDOW``.

    The one rule for step 3's log line and the summary, so both print the same pair.
    """
    return max(1, min(REWARD_WINDOW, count // 4))


def _first_last(values: list, window: bool = False):
    """(first, last) values; with ``window``, means of the first/last :func:`head_tail_window` values."""
    if not values:
        return None, None
    if not window:
        return values[0], values[-1]
    k = head_tail_window(len(values))
    return sum(values[:k]) / k, sum(values[-k:]) / k


def summarize_step(n: int, rows: list) -> dict:
    """Condensed numbers of one step (keys with no data are left out)."""
    out = {}

    def put(key, value):
        if value is not None:
            out[key] = value

    if n == 1:
        _, ppl = series(rows, "eval", "perplexity")
        _, eval_loss = series(rows, "eval", "loss")
        put("perplexity_before", _first_last(ppl)[0])
        put("perplexity_after", _first_last(ppl)[1])
        put("eval_loss", _first_last(eval_loss)[1])
    elif n == 2:
        _, acc = series(rows, "eval", "acc")
        put("accuracy_before", _first_last(acc)[0])
        put("accuracy_after", _first_last(acc)[1])
        put("chosen_score", _first_last(series(rows, "eval", "chosen")[1])[1])
        put("rejected_score", _first_last(series(rows, "eval", "rejected")[1])[1])
    elif n == 3:
        start, end = _first_last(series(rows, "train", "reward")[1], window=True)
        put("reward_start", start)
        put("reward_end", end)
        put("kl_end", _first_last(series(rows, "train", "kl")[1])[1])  # the last step's, as step 3 logs it
        put("actor_loss_end", _first_last(series(rows, "train", "actor_loss")[1])[1])
        put("critic_loss_end", _first_last(series(rows, "train", "critic_loss")[1])[1])
    steps, train_loss = series(rows, "train", "loss")
    put("final_train_loss", _first_last(train_loss)[1])
    put("optimizer_steps", max((r.get("step", 0) for r in rows if isinstance(r.get("step"), int)), default=None))
    return out


def _f(value, digits=3) -> str:
    if value is None:
        return "-"
    return f"{value:.{digits}g}" if abs(value) >= 1000 else f"{value:.{digits}f}"


def describe(n: int, s: dict) -> str:
    """One human-readable line of results for step ``n``."""
    parts = []
    if n == 1:
        if "perplexity_after" in s:
            parts.append(f"eval ppl {_f(s.get('perplexity_before'), 1)} -> {_f(s['perplexity_after'], 2)}")
        if "eval_loss" in s:
            parts.append(f"eval loss {_f(s['eval_loss'])}")
    elif n == 2:
        if "accuracy_after" in s:
            parts.append(f"eval acc {_f(s.get('accuracy_before'))} -> {_f(s['accuracy_after'])}")
        if "chosen_score" in s or "rejected_score" in s:
            parts.append(f"chosen {_f(s.get('chosen_score'))} / rejected {_f(s.get('rejected_score'))}")
    elif n == 3:
        if "reward_end" in s:
            parts.append(f"reward {_f(s.get('reward_start'))} -> {_f(s['reward_end'])}")
        if "kl_end" in s:
            parts.append(f"KL at the last step {_f(s['kl_end'], 4)}")
        if "actor_loss_end" in s or "critic_loss_end" in s:
            parts.append(f"actor loss {_f(s.get('actor_loss_end'))}, critic loss {_f(s.get('critic_loss_end'))}")
    if "final_train_loss" in s:
        parts.append(f"final train loss {_f(s['final_train_loss'])}")
    return ", ".join(parts) or "(no metrics)"


def _fmt_time(seconds) -> str:
    return "-" if seconds is None else str(datetime.timedelta(seconds=int(round(seconds))))


def format_table(summary: dict) -> str:
    rows = [("step", "wall time", "results")]
    algorithm = summary.get("step3_algorithm", DEFAULT_ALGORITHM)
    for key, s in summary["steps"].items():
        rows.append((STEP_NAMES[int(key)].format(algorithm=algorithm), _fmt_time(s.get("wall_time_s")),
                     describe(int(key), s)))
    rows.append(("total", _fmt_time(summary.get("total_wall_time_s")), ""))
    widths = [max(len(r[i]) for r in rows) for i in range(2)]
    lines = [f"{a:<{widths[0]}}  {b:>{widths[1]}}  {c}".rstrip() for a, b, c in rows]
    lines.insert(1, "-" * max(len(line) for line in lines))
    if summary.get("heldout"):
        lines += ["", format_heldout(summary["heldout"], algorithm)]
    return "\n".join(lines)


HELDOUT_ACTORS = {"1": "1 SFT actor", "3": "3 {algorithm} actor"}


def heldout_actor(step: str, algorithm: str) -> str:
    return HELDOUT_ACTORS.get(step, step).format(algorithm=algorithm)
CHECK_NAMES = {"names_object": "names object", "only_good": "only good", "no_repeat": "no repeat",
               "well_formed": "well formed"}


def format_heldout(heldout: dict, algorithm: str = DEFAULT_ALGORITHM) -> str:
    """The held-out check as text: one line per actor and kind of answers, then the reward model's accuracy per kind
    (``algorithm``: step 3's name)."""
    lines = []
    actors = heldout.get("actors") or {}
    if actors:
        sampling = heldout.get("sampling")
        lines.append(f"held-out check without the reward model ({heldout.get('prompts')} built-in eval prompts; "
                     "rule score = share of the checks passed):")
        if sampling:
            lines.append(f"  greedy answers, and {sampling['per_prompt']} answers per prompt sampled with "
                         f"step 3's settings (temperature {sampling['temperature']:g}, top_k {sampling['top_k']}, "
                         f"top_p {sampling['top_p']:g}; seed {sampling['seed']})")
        head = ["actor", "answers", "rule score", *CHECK_NAMES.values(), "all four", "mean words"]
        table = [head]
        kinds = [("greedy", None)] + ([(f"{sampling['per_prompt']} sampled", "sampled")] if sampling else [])
        for label, key in kinds:
            for step, report in sorted(actors.items()):
                a = report if key is None else report.get(key) or {}
                checks = a.get("checks", {})
                table.append([heldout_actor(step, algorithm), label, _f(a.get("rule_score")),
                              *(_f(checks.get(name)) for name in CHECK_NAMES), _f(a.get("all_four")),
                              _f(a.get("mean_words"), 1)])
        widths = [max(len(r[i]) for r in table) for i in range(len(head))]
        lines += ["  " + "  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
                  for r in table]
        for step, a in sorted(actors.items()):
            if a.get("samples"):
                sample = a["samples"][0]
                lines.append(f"  {heldout_actor(step, algorithm)}, greedy: {sample['prompt']} {sample['answer']}")
    rm = heldout.get("reward_model")
    if rm:
        acc = rm.get("accuracy", {})
        kinds = ", ".join(f"{k} {_f(v)}" for k, v in acc.items() if k != "overall")
        lines.append(f"reward model on {rm.get('pairs')} held-out pairs: accuracy {_f(acc.get('overall'))} "
                     f"(per rejected kind: {kinds})")
        scale = rm.get("scale")
        if scale and scale.get("ranked"):
            ranked = ", ".join(f"{pair.replace('_', ' ').replace('>', ' > ')} {_f(v)}"
                               for pair, v in scale["ranked"].items())
            lines.append(f"reward model on answers drawn independently for the same prompt ({scale['per_class']} "
                         f"per kind and prompt), share ranked as the rules rank them: {ranked}")
    return "\n".join(lines)


def build_summary(folders: dict, times: dict) -> dict:
    """``folders``: step -> output folder; ``times``: step -> wall seconds (steps run now)."""
    steps = {}
    for n, folder in sorted(folders.items()):
        rows = read_metrics(os.path.join(folder, "metrics.jsonl"))
        if not rows and n not in times:
            continue
        s = {"output_dir": folder, "wall_time_s": times.get(n), **summarize_step(n, rows)}
        steps[str(n)] = s
    total = sum(times.values()) if times else None
    return {"steps": steps, "total_wall_time_s": total}


# --------------------------------------------------------------------------- curves

def _panel(ax, title, curves, ylabel, logy=False):
    """``curves``: [(label, xs, ys)]; an empty panel says so instead of failing."""
    ax.set_title(title, fontsize=10)
    drawn = False
    for label, xs, ys in curves:
        if ys:
            ax.plot(xs, ys, marker="o" if len(ys) < 15 else None, markersize=3, label=label)
            drawn = True
    if not drawn:
        ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes, color="gray")
        ax.set_xticks([])
        ax.set_yticks([])
        return
    if logy:
        ax.set_yscale("log")
    ax.set_xlabel("optimizer step", fontsize=8)
    ax.set_ylabel(ylabel, fontsize=8)
    ax.tick_params(labelsize=8)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)


def _smooth(ys: list, k: int = 5) -> list:
    return [sum(ys[max(0, i - k + 1):i + 1]) / len(ys[max(0, i - k + 1):i + 1]) for i in range(len(ys))]


def _bars(ax, title, groups: dict, ylabel):
    """``groups``: {series label: {bar label: value}}, drawn side by side; an empty panel says so."""
    ax.set_title(title, fontsize=10)
    labels = list(dict.fromkeys(k for values in groups.values() for k in values))
    if not labels:
        ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes, color="gray")
        ax.set_xticks([])
        ax.set_yticks([])
        return
    width = 0.8 / len(groups)
    for i, (series_label, values) in enumerate(groups.items()):
        xs = [j + (i - (len(groups) - 1) / 2) * width for j in range(len(labels))]
        ax.bar(xs, [values.get(k, 0.0) for k in labels], width=width, label=series_label)
    ax.set_xticks(range(len(labels)))
    ax.set_xticklabels([k.replace("_", " ") for k in labels], rotation=30, ha="right", fontsize=7)
    ax.set_ylim(0, 1.2 if len(groups) <= 2 else 1.45)  # room for the legend above the bars
    ax.set_ylabel(ylabel, fontsize=8)
    ax.tick_params(labelsize=8)
    ax.grid(alpha=0.3, axis="y")
    if len(groups) > 1:
        ax.legend(fontsize=7, loc="upper center", ncol=min(len(groups), 2))


def _heldout_panels(ax_rm, ax_rules, heldout: dict | None, algorithm: str) -> None:
    heldout = heldout or {}
    accuracy = (heldout.get("reward_model") or {}).get("accuracy", {})
    _bars(ax_rm, "Step 2: held-out accuracy per rejected kind", {"accuracy": accuracy} if accuracy else {},
          "accuracy")
    groups = {}
    for suffix, key in (("", None), (", sampled", "sampled")):
        for step, report in sorted((heldout.get("actors") or {}).items()):
            a = report if key is None else report.get(key)
            if a:
                groups[heldout_actor(step, algorithm) + suffix] = {
                    "rule score": a.get("rule_score", 0.0), **a.get("checks", {}), "all four": a.get("all_four", 0.0)}
    _bars(ax_rules, "Held-out rule score (no reward model)", groups, "share of answers / score")


def plot_curves(folders: dict, png_path: str, heldout: dict | None = None, algorithm: str = DEFAULT_ALGORITHM) -> str:
    """Draw the 2×4 grid of training curves (last column: the held-out check) to ``png_path``; returns the path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = {n: read_metrics(os.path.join(folder, "metrics.jsonl")) for n, folder in folders.items()}
    r1, r2, r3 = rows.get(1, []), rows.get(2, []), rows.get(3, [])
    fig, axes = plt.subplots(2, 4, figsize=(17, 7))
    _panel(axes[0, 0], "Step 1: SFT loss", [("train", *series(r1, "train", "loss")),
                                            ("eval", *series(r1, "eval", "loss"))], "loss")
    _panel(axes[0, 1], "Step 1: eval perplexity", [("eval", *series(r1, "eval", "perplexity"))], "perplexity",
           logy=True)
    _panel(axes[0, 2], "Step 2: reward-model accuracy (eval)", [("accuracy", *series(r2, "eval", "acc"))],
           "accuracy")
    _panel(axes[1, 0], "Step 2: reward-model loss", [("train", *series(r2, "train", "loss")),
                                                     ("eval", *series(r2, "eval", "loss"))], "loss")
    xs, ys = series(r3, "train", "reward")
    _panel(axes[1, 1], "Step 3: reward", [("reward", xs, ys), ("moving average (5)", xs, _smooth(ys))], "reward")
    _panel(axes[1, 2], "Step 3: KL(actor || reference)", [("KL", *series(r3, "train", "kl"))], "KL")
    _heldout_panels(axes[0, 3], axes[1, 3], heldout, algorithm)
    fig.suptitle("RLHF training curves", fontsize=12)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(png_path)), exist_ok=True)
    fig.savefig(png_path, dpi=100)
    plt.close(fig)
    return png_path


def write_summary(output_dir: str, folders: dict, times: dict, heldout: dict | None = None,
                  step3_algorithm: str = DEFAULT_ALGORITHM) -> str:
    """Write ``summary.json`` and ``training_curves.png`` under ``output_dir``; returns the printed text.

    ``heldout``: the held-out check (:func:`utils.heldout.heldout_check`), if one was made; ``step3_algorithm``:
    step 3's name in the table ("GRPO": a critic-free run is not called PPO).
    """
    summary = build_summary(folders, times)
    summary["step3_algorithm"] = step3_algorithm
    if heldout:
        summary["heldout"] = heldout
    json_path = os.path.join(output_dir, "summary.json")
    png_path = os.path.join(output_dir, "training_curves.png")
    summary["curves_png"] = png_path
    with writing("the run's summary", json_path):
        os.makedirs(output_dir, exist_ok=True)
        with open(json_path, "w") as f:
            json.dump(summary, f, indent=2)
    with writing("the training curves", png_path):
        plot_curves(folders, png_path, heldout, step3_algorithm)
    return f"{format_table(summary)}\n\nsummary: {json_path}\ncurves:  {png_path}"
