"""Step 3's algorithms as specs: one :class:`EstimatorSpec` per advantage estimator and one :class:`PolicyLossSpec` per
policy loss. The flags' choices, their defaults, step 3's checks, train.py's names for a run and the tables of
docs/algorithms.md all derive from these two tables; the maths is in :mod:`utils.rl_math`.

Adding an estimator: its per-answer function in ``utils/rl_math.py`` and its spec here. Adding a policy loss: its
per-token function in ``utils/rl_math.py`` and its spec here. Then ``python scripts/gen_readme_tables.py`` rewrites
docs/flags.md and docs/algorithms.md (a test fails while they are stale).

This module stays free of torch (train.py reads the specs): the functions are named, and looked up in
:mod:`utils.rl_math` when step 3 runs.
"""
from __future__ import annotations

from dataclasses import dataclass

# How the per-token losses of an optimizer step become one number (verl's names, with underscores); each divides the
# step's sum by a count taken over the step's micro-batches on every rank (utils.rl_math.aggregate_loss).
LOSS_AGGREGATIONS = {
    "token_mean": "the mean over every counted answer token of the step (DAPO's token-level loss)",
    "seq_mean_token_mean": "each answer's token mean, averaged over the answers with a counted token (GRPO's paper, "
                           "GSPO)",
    "seq_mean_token_sum_norm": "each answer's token sum over the constant --max_answer_seq_len, averaged over the "
                               "answers (Dr. GRPO: a token weighs the same in a long and a short answer)",
}


@dataclass(frozen=True)
class EstimatorSpec:
    """One ``--advantage_estimator``: how advantages are made and what the estimator brings with it by default."""
    name: str
    title: str  # a run's name in logs, train.py's step names and the summary ("GRPO")
    advantage: str | None  # the per-answer function in utils.rl_math; None: GAE with the critic's values
    critic: bool  # trains a value model (--critic_* flags, critic/ saved)
    group: bool  # compares the answers of one prompt: needs --n_samples_per_prompt ≥ 2
    whiten: bool  # token advantages whitened over the batch of every rank afterwards
    kl_in_loss: bool  # default of --use_kl_loss: β·KL in the loss (True) or in the reward (False)
    kl_estimator: str  # default of --kl_estimator
    loss_agg: str  # default of --loss_agg (a key of LOSS_AGGREGATIONS)
    formula: str  # docs: the advantage of each token of answer i
    source: str  # docs: where it comes from
    aliases: tuple = ()  # other names --advantage_estimator accepts

    def advantage_function(self):
        """The per-answer function ``(scores [N], group_size, valid [N]) -> [N]`` of :mod:`utils.rl_math`."""
        from utils import rl_math

        return getattr(rl_math, self.advantage)


@dataclass(frozen=True)
class PolicyLossSpec:
    """One ``--policy_loss``: the per-token loss of the actor, its clip range and, where the method defines one, its
    aggregation."""
    name: str
    title: str
    function: str  # the per-token function in utils.rl_math
    cliprange: float  # default of --cliprange (the lower clip ε_low)
    cliprange_high: float | None  # default of --cliprange_high (None: --cliprange)
    loss_agg: str | None  # default of --loss_agg where the method fixes one (None: the estimator's)
    formula: str  # docs: the loss of token t
    source: str  # docs

    def loss_function(self):
        """``(log_probs, old_log_probs, advantages, action_mask, clip_low, clip_high) -> [B, A]`` per-token losses."""
        from utils import rl_math

        return getattr(rl_math, self.function)


ESTIMATORS = {spec.name: spec for spec in (
    EstimatorSpec("gae", "PPO", None, critic=True, group=False, whiten=False, kl_in_loss=False, kl_estimator="k1",
                  loss_agg="token_mean",
                  formula="GAE(γ, λ) over per-token rewards: −β·KL per token, the score on the last one",
                  source="PPO with a critic, as DeepSpeed-Chat"),
    EstimatorSpec("grpo", "GRPO", "grpo_advantages", critic=False, group=True, whiten=False, kl_in_loss=True,
                  kl_estimator="k3", loss_agg="token_mean",
                  formula="(r_i − mean_g) / (std_g + ε), std with n − 1",
                  source="DeepSeekMath; OpenRLHF's `group_norm`", aliases=("group_norm",)),
    EstimatorSpec("dr_grpo", "Dr. GRPO", "dr_grpo_advantages", critic=False, group=True, whiten=False,
                  kl_in_loss=True, kl_estimator="k3", loss_agg="seq_mean_token_sum_norm",
                  formula="r_i − mean_g", source="Liu et al. 2025, \"Understanding R1-Zero-like training\""),
    EstimatorSpec("rloo", "RLOO", "rloo_advantages", critic=False, group=True, whiten=False, kl_in_loss=False,
                  kl_estimator="k1", loss_agg="token_mean",
                  formula="r_i − mean of the group's other answers", source="Ahmadian et al. 2024"),
    EstimatorSpec("reinforce_baseline", "REINFORCE++-baseline", "reinforce_baseline_advantages", critic=False,
                  group=True, whiten=True, kl_in_loss=False, kl_estimator="k1", loss_agg="token_mean",
                  formula="r_i − mean_g, then KL-penalised returns whitened over the batch of every rank",
                  source="Hu et al. 2025"),
    EstimatorSpec("reinforce", "REINFORCE++", "reinforce_advantages", critic=False, group=False, whiten=True,
                  kl_in_loss=False, kl_estimator="k1", loss_agg="token_mean",
                  formula="KL-penalised token rewards, discounted returns (γ), whitened over the batch of every rank",
                  source="Hu et al. 2025"),
)}
ESTIMATOR_ALIASES = {alias: spec.name for spec in ESTIMATORS.values() for alias in spec.aliases}

POLICY_LOSSES = {spec.name: spec for spec in (
    PolicyLossSpec("ppo", "PPO", "ppo_policy_loss", cliprange=0.2, cliprange_high=None, loss_agg=None,
                   formula="max(−Â_t·ρ_t, −Â_t·clip(ρ_t, 1 − ε_low, 1 + ε_high)), ρ_t = π/π_old of the token",
                   source="Schulman et al. 2017 (DeepSpeed-Chat's); DAPO's clip-higher with --cliprange_high"),
    PolicyLossSpec("gspo", "GSPO", "gspo_policy_loss", cliprange=3e-4, cliprange_high=4e-4,
                   loss_agg="seq_mean_token_mean",
                   formula="the same with ρ_t = s_i = exp(mean over the answer's tokens of log π/π_old) (its "
                           "gradient flows through each token: GSPO-token, equal to GSPO for one advantage per answer)",
                   source="Zheng et al. 2025 (Qwen), TRL's importance_sampling_level=\"sequence\"; its ε 3e-4 / 4e-4"),
    PolicyLossSpec("cispo", "CISPO", "cispo_policy_loss", cliprange=1.0, cliprange_high=4.0, loss_agg=None,
                   formula="−sg(clip(ρ_t, 1 − ε_low, 1 + ε_high))·Â_t·log π_t: the weight is clipped and detached, "
                           "so every token keeps its gradient",
                   source="MiniMax-M1 2025 (no lower bound: ε_low 1); ε_high 4, a weight of at most 5, as TRL "
                          "recommends (ScaleRL)"),
)}


def estimator_spec(name: str) -> EstimatorSpec:
    """The spec of ``name`` (an alias too); ValueError for an unknown one."""
    spec = ESTIMATORS.get(ESTIMATOR_ALIASES.get(name, name))
    if spec is None:
        raise ValueError(f"unknown advantage estimator {name!r}")
    return spec


def policy_loss_spec(name: str) -> PolicyLossSpec:
    spec = POLICY_LOSSES.get(name)
    if spec is None:
        raise ValueError(f"unknown policy loss {name!r}")
    return spec


def run_title(estimator: str, policy_loss: str) -> str:
    """How logs, train.py and the summary name a step-3 run: "PPO", "GRPO", "GRPO with GSPO's loss"."""
    title = estimator_spec(estimator).title
    return title if policy_loss == "ppo" else f"{title} with {policy_loss_spec(policy_loss).title}'s loss"


# --------------------------------------------------------------------------- help texts and docs tables

def _by_value(pairs) -> str:
    """``"a for x, y; b for z"`` from ``(name, value)`` pairs, values in their first order."""
    groups: dict = {}
    for name, value in pairs:
        groups.setdefault(value, []).append(name)
    return "; ".join(f"{value} for {', '.join(names)}" for value, names in groups.items())


def default_help(field: str) -> str:
    """The per-estimator (or per-policy-loss) defaults of a flag, for its help text."""
    if field == "kl_estimator":
        return _by_value((s.name, s.kl_estimator) for s in ESTIMATORS.values())
    if field == "use_kl_loss":
        return _by_value((s.name, "in the loss" if s.kl_in_loss else "in the reward") for s in ESTIMATORS.values())
    if field == "loss_agg":
        fixed = [f"{s.loss_agg} for --policy_loss {s.name}" for s in POLICY_LOSSES.values() if s.loss_agg]
        return "; ".join(fixed + [_by_value((s.name, s.loss_agg) for s in ESTIMATORS.values())])
    if field == "whiten":
        return _by_value((s.name, "on" if s.whiten else "off") for s in ESTIMATORS.values())
    if field in ("cliprange", "cliprange_high"):
        pairs = [(s.name, getattr(s, field) if getattr(s, field) is not None else "--cliprange")
                 for s in POLICY_LOSSES.values()]
        return _by_value(pairs)
    raise KeyError(field)


def estimator_table() -> str:
    """docs/algorithms.md's estimator table (markdown)."""
    rows = ["| estimator | advantage of each token of answer i | critic | G | KL default | loss aggregation default |"
            " source |", "|---|---|---|---|---|---|---|"]
    for s in ESTIMATORS.values():
        names = ", ".join(f"`{n}`" for n in (s.name, *s.aliases))
        rows.append(f"| {names} ({s.title}) | {s.formula} | {'yes' if s.critic else 'no'} | "
                    f"{'≥ 2' if s.group else '≥ 1'} | {s.kl_estimator} in the {'loss' if s.kl_in_loss else 'reward'} | "
                    f"`{s.loss_agg}` | {s.source} |")
    return "\n".join(rows) + "\n"


def policy_loss_table() -> str:
    """docs/algorithms.md's policy-loss table (markdown)."""
    rows = ["| policy loss | loss of token t of answer i | default ε_low / ε_high | loss aggregation | source |",
            "|---|---|---|---|---|"]
    for s in POLICY_LOSSES.values():
        high = s.cliprange if s.cliprange_high is None else s.cliprange_high
        agg = f"`{s.loss_agg}`" if s.loss_agg else "the estimator's"
        rows.append(f"| `{s.name}` ({s.title}) | {s.formula} | {s.cliprange:g} / {high:g} | {agg} | {s.source} |")
    return "\n".join(rows) + "\n"


def loss_aggregation_table() -> str:
    rows = ["| `--loss_agg` | the actor's loss of an optimizer step |", "|---|---|"]
    rows += [f"| `{name}` | {text} |" for name, text in LOSS_AGGREGATIONS.items()]
    return "\n".join(rows) + "\n"


DOC_TABLES = {"estimators": estimator_table, "policy_losses": policy_loss_table,
              "loss_aggregations": loss_aggregation_table}
