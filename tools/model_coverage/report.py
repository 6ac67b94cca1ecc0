"""Which families to run, how each one went, and the markdown table of docs/model_coverage.md."""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field
from typing import Any

from tools.model_coverage import parity

#: Families the plan-driven path must pass (issue 55's acceptance list).
REQUIRED = (
    "gemma2",
    "gemma3_text",
    "phi3",
    "qwen3",
    "granite",
    "olmo2",
    "cohere",
    "starcoder2",
    "glm",
    "llama4_text",
)


@dataclass
class Row:
    """One family of the table."""

    family: str
    model_class: str
    path: str = ""
    result: str = ""
    detail: str = ""
    has_plan: bool = False
    shipped: bool = False
    runs: bool = False
    per_rank: Any = field(default=None, repr=False)


def _config_classes(config_cls: Any) -> list[Any]:
    """The family's config class and its sub-configs' classes.

    For an ``AutoConfig`` entry, the class of the default config's own sub-config.
    """
    classes = [config_cls]
    for name, sub in (getattr(config_cls, "sub_configs", None) or {}).items():
        if getattr(sub, "__name__", "") == "AutoConfig":
            try:
                sub = type(getattr(config_cls(), name, None))
            except Exception:  # noqa: BLE001 - a config that cannot be built by default
                continue
        classes.append(sub)
    return classes


def classify(family: str, model_class: str) -> Row:
    """Decides in the parent, without ranks, whether ``family`` runs, and by which path."""
    from transformers import CONFIG_MAPPING

    from tools.model_coverage.parity import error_summary
    from tools.model_coverage.tiny import build, tiny_config
    from torch_sagemaker.policies import lookup_policy, registered_policies
    from torch_sagemaker.policies.shipped_plans import SHIPPED_PLANS
    from torch_sagemaker.policies.transformers_plan import PLAN_TP_NOTE

    row = Row(family, model_class)
    by_policy = any(model_class in p.model_classes for p in registered_policies())
    try:
        config_cls = CONFIG_MAPPING[family]
    except Exception as e:  # noqa: BLE001 - reported in the table
        row.result, row.detail = "skip", f"no config class: {error_summary(e)}"
        return row
    # A multimodal family's plan is on its text sub-config (transformers merges it into
    # model.tp_plan under the text model's prefix).
    row.has_plan = any(getattr(c, "base_model_tp_plan", None) for c in _config_classes(config_cls))
    # (A family may share another's config class, whose model_type the library reads:
    # gpt-sw3's is GPT2Config, model_type "gpt2"; or build its causal LM from a sub-config:
    # mllama's MllamaForCausalLM, from its "mllama_text_model".)
    row.shipped = family in SHIPPED_PLANS or any(
        getattr(c, "model_type", "") in SHIPPED_PLANS for c in _config_classes(config_cls)
    )
    if not by_policy and not row.has_plan and not row.shipped:
        row.path, row.result = "none", "skip"
        row.detail = (
            "no policy; transformers ships no base_model_tp_plan for it, and torch_sagemaker "
            "no plan"
        )
        return row
    plan_path = "plan" if row.has_plan or not row.shipped else "shipped plan"
    try:
        config = tiny_config(family)
        row.has_plan = row.has_plan or bool(getattr(config, "base_model_tp_plan", None))
        model = build(family, device="meta")
    except Exception as e:  # noqa: BLE001 - reported in the table
        row.path = "policy" if by_policy else plan_path
        if isinstance(e, ImportError):  # a package the family needs is missing here (timm)
            row.result, row.detail = (
                "skip",
                f"needs a package not installed here: {error_summary(e)}",
            )
        else:
            row.result = "fail"
            row.detail = f"the tiny config does not build: {error_summary(e)}"
        return row
    try:
        policy = lookup_policy(model)
    except ValueError as e:
        row.path, row.result, row.detail = plan_path, "refused", error_summary(e)
        return row
    except Exception as e:  # noqa: BLE001 - a defect of the translation, reported as such
        row.path, row.result = plan_path, "fail"
        row.detail = f"the plan translation raised {error_summary(e)}"
        return row
    if policy.name.endswith("(transformers plan)"):
        row.path = "plan"
    elif policy.name.endswith("(shipped plan)"):
        row.path = "shipped plan"
    elif PLAN_TP_NOTE in policy.notes:
        row.path = f"policy `{policy.name}`, TP from the plan"
    else:
        row.path = f"policy `{policy.name}`"
    # A config the plan cannot split is refused by tsm.transform, as a plan is above.
    reason = policy.layout_check(model.config, parity.TP) if policy.layout_check else ""
    if reason:
        row.result, row.detail = "refused", f"{policy.name}: {reason}".replace("|", "/")
        return row
    row.runs = True
    return row


def settle(row: Row, outcome: Any) -> None:
    """Fills ``row`` from the launch's outcome: per-rank results, or an error string."""
    if isinstance(outcome, str):
        row.result, row.detail = "fail", outcome
        return
    row.per_rank = outcome
    verdicts = [parity.passed(r) for r in outcome]
    bad = [(rank, why) for rank, (ok, why) in enumerate(verdicts) if not ok]
    if bad:
        rank, why = bad[0]
        row.result, row.detail = "fail", f"rank {rank}: {why}"
        return
    worst = {
        "logits": max(r["forward"]["logits"]["max"] for r in outcome),
        "loss": max(r["forward"]["loss"]["max"] for r in outcome),
        "grads": max(r["grads"]["max"] for r in outcome),
        "params": max(r["params"]["max"] for r in outcome),
    }
    share = outcome[0]["split_share"]
    sensitivity = max(r["sensitivity"] for r in outcome)
    row.result = "pass"
    row.detail = f"{share:.0%} of parameters split; max diff " + ", ".join(
        f"{k} {v:.1e}" for k, v in worst.items()
    )
    if sensitivity:
        row.detail += (
            f" (parameters within 10x the model's own sensitivity: a {parity.PERTURBATION:g} "
            f"perturbation moves them by up to {sensitivity:.1e} in one process)"
        )


def markdown(rows: list[Row], command: str, versions: dict[str, str], fsdp: int = 2) -> str:
    """docs/model_coverage.md (``fsdp``: the FSDP version the families were wrapped in)."""
    counts: dict[str, int] = {}
    for row in rows:
        counts[row.result] = counts.get(row.result, 0) + 1
    planned = [r for r in rows if r.has_plan]
    plan_pass = sum(r.result == "pass" for r in planned)
    shipped = [r for r in rows if r.path == "shipped plan"]
    shipped_pass = sum(r.result == "pass" for r in shipped)
    required = {r.family: r.result for r in rows if r.family in REQUIRED}
    lines = [
        "# Model coverage: tensor parallelism over transformers' causal-LM families",
        "",
        f"Generated by `{command}` on {datetime.date.today().isoformat()} with "
        + ", ".join(f"{k} {v}" for k, v in versions.items())
        + ". Do not edit by hand; rerun the command.",
        "",
        "Every family of transformers' causal-LM registry (`MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`) "
        "gets a tiny config built locally (hidden 64, 2 layers, 4 heads of 16, 2 kv heads, "
        "vocabulary 128, 4 experts; `tools/model_coverage/tiny.py`) and runs with "
        f"`tensor_parallel_degree={parity.TP}`, `hybrid_shard_degree={parity.HYBRID_SHARD}` "
        "on 4 CPU ranks (gloo), with activation checkpointing and "
        + (
            "FSDP1 as SMP's example scripts wrap (`HYBRID_SHARD`, `use_orig_params=True`, "
            "one unit per transformer layer; gradients and parameters compared whole, inside "
            "`summon_full_params`)"
            if fsdp == 1
            else "FSDP2 on the transformer layers"
        )
        + ", against the same model in one process: logits and loss of each rank's batch, "
        f"every gradient, the loss at each of {parity.STEPS} SGD steps (lr {parity.LR}, momentum "
        f"{parity.MOMENTUM}; why not AdamW: `tools/model_coverage/parity.py`) and every "
        "parameter after them. Tolerances: |difference| <= "
        f"{parity.ATOL:g} + {parity.RTOL:g} x (largest reference magnitude) for logits and "
        f"loss, {parity.ATOL:g} + {parity.RTOL * 10:g} x for gradients, {parity.PARAM_ATOL:g} "
        "for parameters after the steps.",
        "",
        "- **path**: `policy` (a shipped policy covers the class and wins), `plan` (the model's "
        "own `base_model_tp_plan`, docs/tensor_parallel.md), `shipped plan` (transformers ships "
        "none; `torch_sagemaker/policies/shipped_plans.py` gives the family one), `none`.",
        "- **result**: `pass`; `fail` (with the first rank's reason); `refused` (`tsm.transform` "
        "refuses the model with the error shown, before any rank runs); `skip` (nothing to run, "
        "or a package the family needs is not installed).",
        "",
        "Summary: "
        + ", ".join(f"{n} {k}" for k, n in sorted(counts.items()))
        + f" of {len(rows)} families; {plan_pass} of the {len(planned)} families whose config "
        f"carries a `base_model_tp_plan` pass; {shipped_pass} of the {len(shipped)} with a "
        "shipped plan pass. Required families: "
        + ", ".join(f"{f} {required.get(f, 'not run')}" for f in REQUIRED)
        + ".",
        "",
        "| family | model class | path | result | detail |",
        "|---|---|---|---|---|",
    ]
    for row in sorted(rows, key=lambda r: r.family):
        detail = row.detail.replace("|", "\\|")
        lines.append(f"| {row.family} | {row.model_class} | {row.path} | {row.result} | {detail} |")
    return "\n".join(lines) + "\n"
