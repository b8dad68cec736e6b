"""The end-of-run report: printed, and written by the run's logger to <output_dir>/summary.json
and the W&B run's summary. Everything in it is measured by the run itself; a value that does
not apply (no GPU: no MFU or memory; no target) is null rather than made up."""
from __future__ import annotations

from ..observe.metrics import mfu


def build(facts: dict, st, record, prec, outcome: dict, fp8=None) -> dict:
    """`facts`: what the run decided at start (its derived values, model, target, peak FLOP/s);
    `st`: the TrainState; `record`: the evaluator's (evaluator.EvalRecord); `prec`: the
    precision as it ended (a rollback may have turned FP8 off); `outcome`: status, exit_code,
    final_val ((step, val/loss) of the last evaluation), latest_checkpoint and peak_memory_gb;
    `fp8`: the precision's verdict facts (its `report`; None: no verdict, as for a run without
    FP8)."""
    precision, handed_over = prec.derived(), prec.state_dict().get("handed_over_tokens")
    steady = st.steady_seconds > 0
    tok_s = st.steady_tokens / st.steady_seconds if steady else None
    target = facts["target_val_loss"]
    met = target is not None and record.target_step is not None and record.target == target
    best, final_val = record.best_val_loss, outcome["final_val"]
    world = facts["world_size"]
    return {
        "status": outcome["status"], "exit_code": outcome["exit_code"],
        "steps": st.step, "total_steps": facts["total_steps"], "tokens": st.tokens,
        "final_val_loss": final_val[1] if final_val else None,
        "final_val_step": final_val[0] if final_val else None,
        "best_val_loss": best, "best_val_step": record.best_val_step,
        "target_val_loss": target,
        "target_met": met if target is not None else None,
        "time_to_target_s": record.time_to_target_s if met else None,
        "tokens_to_target": record.tokens_to_target if met else None,
        "step_at_target": record.target_step if met else None,
        "target_gap": (best - target) if target is not None and not met and best is not None
        else None,
        "wall_time_s": st.wall_seconds,
        # this invocation's first step, start-up's compiles included (a resume has its own)
        "first_step_s": outcome.get("first_step_s"),
        "train_time_s": st.train_seconds,
        "tokens_per_sec": tok_s,
        "mfu": mfu(facts["flops_per_token"], tok_s / world, facts["peak_flops"])
        if tok_s else None,
        "steady_state_tokens": st.steady_tokens,
        "peak_memory_gb": outcome["peak_memory_gb"],
        "batch": {k: facts[k] for k in ("micro_batch_size", "gradient_accumulation_steps",
                                         "world_size", "effective_batch_size",
                                         "tokens_per_step")},
        "precision": precision.get("precision"), "fp8": precision.get("fp8"),
        "fp8_layers_converted": precision.get("fp8_layers", 0),
        # fp8_until: the tokens trained in FP8 and, after the hand-over, in the base precision
        "tokens_fp8": handed_over,
        "tokens_after_fp8": None if handed_over is None else st.tokens - handed_over,
        # fp8_check_interval: checks, last, mean and largest FP8 - high-precision loss
        "fp8_loss_gap": outcome.get("fp8_loss_gap"),
        # fp8_recipe / fp8_backend auto: the recipe chosen and the table behind it
        "fp8_choice": precision.get("fp8_choice"),
        "model": facts["model"], "n_params": facts["n_params"],
        "skipped_steps": st.skipped_steps, "rollbacks": st.rollbacks,
        "checkpoints_written": st.checkpoints_written,
        "latest_checkpoint": outcome["latest_checkpoint"],
        "fp8_verdict": _fp8_verdict(fp8, facts, tok_s),
        # hellaswag_interval: the last evaluation's acc, acc_norm (per token), examples, step
        "hellaswag": outcome.get("hellaswag"),
    }


def _fp8_verdict(fp8, facts: dict, tok_s):
    """What FP8 bought this run (precision/verdict.py), from its steady-state step time."""
    if fp8 is None:
        return None
    return fp8.verdict(facts["flops_per_token"], tok_s, facts["tokens_per_step"],
                       facts["gradient_accumulation_steps"])


def describe(s: dict) -> list[str]:
    """The report as log lines."""
    def num(v, fmt):
        return "n/a" if v is None else format(v, fmt)
    lines = [f"summary: {s['status']} at step {s['steps']:,}/{s['total_steps']:,}, "
             f"{s['tokens']:,} tokens, {num(s['wall_time_s'] / 60, '.1f')} min wall "
             f"({num(s['train_time_s'] / 60, '.1f')} min training)",
             f"summary: val/loss final {num(s['final_val_loss'], '.4f')}, best "
             f"{num(s['best_val_loss'], '.4f')}"
             + (f" (step {s['best_val_step']:,})" if s["best_val_step"] is not None else ""),
             f"summary: {num(s['tokens_per_sec'], ',.0f')} tokens/s in the steady state, MFU "
             f"{'n/a' if s['mfu'] is None else format(100 * s['mfu'], '.1f') + '%'}, peak "
             f"memory {'n/a' if s['peak_memory_gb'] is None else format(s['peak_memory_gb'], '.1f') + ' GB'}; "
             f"{s['precision']}"
             + (f" with FP8 ({s['fp8']}, {s['fp8_layers_converted']} layers)"
                if s["fp8_layers_converted"] else "")]
    if s.get("tokens_fp8") is not None:
        lines.append(f"summary: {s['tokens_fp8']:,} tokens trained in FP8, then "
                     f"{s['tokens_after_fp8']:,} in {s['precision']} (fp8_until)")
    choice = s.get("fp8_choice")
    if choice and choice.get("chosen"):
        timed = len([t for t in choice["table"] if t.get("seconds") is not None])
        lines.append(f"summary: FP8 recipe {choice['chosen']} (fp8 auto: "
                     + (f"the fastest of {timed} timed whose numerics passed)" if timed else
                        f"{choice.get('note', 'nothing timed')})"))
    hella = s.get("hellaswag")
    if hella:
        lines.append(f"summary: HellaSwag at step {hella['step']:,}: acc {hella['acc']:.4f}, "
                     f"acc_norm {hella['acc_norm']:.4f} (per {hella['acc_norm_by']}) over "
                     f"{hella['examples']:,} examples")
    gap = s.get("fp8_loss_gap")
    if gap:
        lines.append(f"summary: FP8 - {s['precision']} loss on the same batch: last "
                     f"{gap['last']:+.4f}, mean {num(gap['mean'], '+.4f')}, largest "
                     f"{num(gap['max'], '+.4f')} nats ({gap['checks']} checks)")
    if s["target_val_loss"] is not None:
        t = s["target_val_loss"]
        lines.append(
            f"summary: target val/loss {t:g} MET at step {s['step_at_target']:,} after "
            f"{s['time_to_target_s']:.1f} s of training ({s['tokens_to_target']:,} tokens)"
            if s["target_met"] else
            f"summary: target val/loss {t:g} NOT met: best {num(s['best_val_loss'], '.4f')}, "
            f"gap {num(s['target_gap'], '.4f')}")
    from ..precision import verdict_lines
    return lines + verdict_lines(s.get("fp8_verdict"))
