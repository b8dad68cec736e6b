"""The training loop: `train(cfg)` builds the run (build.py), then steps until the end or a stop.

Every component decides its own cadence: the evaluator when to evaluate, the checkpointer when
to save, the stopper when the ranks agree on a stop, recovery when to roll back. The loop calls
them in order and reads top to bottom.
"""
from __future__ import annotations

import math
import time

import torch

from ..errors import EXIT_STOPPED, as_reported
from ..optim.schedule import lr_at
from .signals import Stopped, StopRequests


def train(cfg, requests: StopRequests) -> int:
    """Train the run `cfg` describes; returns the exit code (0 done, 3 stopped by a signal).
    `requests`: the stop signals, handled from before torch loaded (signals.py). Whatever ends
    the run goes into train.log as the console shows it."""
    from accelerate import PartialState

    from ..observe.logger import Logger
    from .build import build
    log, failed = None, True
    try:
        # Without CUDA, say so up front: under torchrun that selects gloo (multi-process CPU).
        state = PartialState(cpu=not torch.cuda.is_available())
        log = Logger(state.is_main_process)
        requests.announce = state.is_main_process
        run = build(cfg, state, log, requests)
        code = 0 if run is None else Trainer(run).fit()   # None: --plan_only, or no steps left
        failed = False
        return code
    except Stopped as e:   # during start-up: nothing trained, nothing to save
        if log is None:
            raise
        failed = False
        log.preempting()
        log.msg(e.describe())
        return EXIT_STOPPED
    except BaseException as e:
        if log is not None:   # the console's line (cli reports it) or traceback, here too
            from ..batch.plan import memory_hint
            log.fatal(as_reported(e, memory_hint(cfg)))
        raise
    finally:
        if log is not None:
            log.finish(failed=failed)


def step_loss(net, x: torch.Tensor, y: torch.Tensor):
    """(loss, cross-entropy, weighted penalty) of one training micro-batch, computed by the
    model (compiled with its forward: see model.py)."""
    return net.model(x, y, penalty_type=net.loss.penalty_type,
                     penalty_weight=net.loss.penalty_weight)


class Trainer:
    def __init__(self, run):
        self.run = run
        self.acc, self.net, self.feed, self.st = run.acc, run.net, run.feed, run.state
        self.log, self.parts = run.log, run.parts
        self.batches = None
        self.first_step_s = None   # this process's first step, its compile included

    def fit(self) -> int:
        st, p, log = self.st, self.parts, self.log
        if p.evaluator.target_done():
            rec = p.evaluator.record
            log.msg(f"nothing to do: target val/loss {rec.target:g} was reached at step "
                    f"{rec.target_step:,} (stop_at_target: false trains on)")
            return 0   # the run's summary.json, written when it stopped there, stands
        total = self.feed.sched.total_steps
        stop_reason, at_target = None, False
        self.net.model.train()
        self.carry_in()
        p.meter.start()   # training time only: eval and checkpoints excluded
        p.wall.start()
        with p.stopper:   # stop signals are acted on (at step boundaries) from here on
            # Its prefetch thread starts here, where a signal no longer raises: the finally
            # below always closes it (one left running at exit can abort the process).
            self.batches = self.feed.stream(st.data_position)
            try:
                if self.run.eval_pending:   # the checkpoint's evaluation, abandoned at a stop
                    at_target = self.eval_and_save(st.step >= total, None, redo=True)
                    stop_reason = p.stopper.reason
                started, first = time.perf_counter(), True
                while st.step < total and not (stop_reason or at_target):
                    last = st.step + 1 == total
                    logged = p.meter.due(st.step + 1, last)
                    p.profiler.before(st.step + 1)
                    self.fp8_hand_over()
                    lr, grad_norm = self.train_step(logged)
                    p.profiler.after(st.step, p.meter)
                    if first:
                        self.first_step(started, logged)
                        first = False
                    self.note_signal()
                    if logged and self.after_log_step(lr, grad_norm):
                        continue                       # rolled back to the last checkpoint
                    stop_reason = p.stopper.check(st.step, logged, last)
                    at_target = self.eval_and_save(last, stop_reason)
                    # an evaluation abandoned for a signal, or a signal during the save
                    stop_reason = p.stopper.reason
                    p.checkpointer.poll()   # a background checkpoint write that has finished
            finally:
                self.batches.close()
                p.profiler.close()   # a run that ends inside the window still writes it
            return self.finish(stop_reason, at_target)

    def first_step(self, started: float, logged: bool) -> None:
        """Said at once, before the first log interval ends: a log file shows the run is
        training, and the ETA is measured from here, after start-up and warm-up. `started`:
        the loop's start (perf_counter)."""
        if self.acc.device.type == "cuda":
            torch.cuda.synchronize(self.acc.device)   # once: the step's real duration
        self.first_step_s = seconds = time.perf_counter() - started
        if not logged:   # its compile is not the interval's speed: the row times steps 2-N
            self.parts.meter.set_aside(self.st)
        if self.log.progress is not None:
            self.log.progress.first_step(self.st.step, seconds,
                                         None if logged else self.parts.meter.next_row(
                                             self.st.step, self.feed.sched.total_steps))

    def fp8_hand_over(self) -> None:
        """fp8_until: from its step on, the converted layers compute in the base precision
        (the switch the bf16 remedy uses); said once, and recorded for resume and the report."""
        until, st = self.feed.fp8_until_step, self.st
        if until is None or st.step < until:
            return
        what = self.net.prec.hand_over(st.tokens)
        if what is None:   # FP8 off already (a recovery, or the hand-over before a resume)
            return
        self.log.msg(f"fp8_until: step {st.step:,} reached after {st.tokens:,} tokens in FP8; "
                     f"{what}")
        self.log.log({"step": st.step, "tokens": st.tokens, "fp8/on": 0})

    def note_signal(self) -> None:
        """The handler acknowledged a stop signal on the console; train.log gets it here."""
        note = self.parts.stopper.note()
        if note:
            self.log.file_only(note)

    def carry_in(self) -> None:
        """The log interval the checkpoint was taken in, carried on: the next row averages the
        same steps as it would have without the stop."""
        h = self.net.health
        c = h.carried
        if not c.steps:
            return
        good = c.steps - c.bad
        h.loss_sum.fill_(c.loss_sum)
        h.penalty_sum.fill_(c.penalty_sum)
        h.bad.fill_(c.bad)
        h.good.fill_(good)
        h.loss_max.fill_(c.loss_max if good else -math.inf)
        self.parts.meter.carry(c.steps)

    def carry_out(self) -> None:
        """The log interval in progress, into the state the checkpoint saves (the health's
        `carried`): its loss sums are on the device, so a checkpoint between log steps costs
        one host sync."""
        h, steps = self.net.health, self.parts.meter.pending
        c = h.carried
        c.steps, c.bad = steps, 0
        c.loss_sum = c.penalty_sum = c.loss_max = 0.0
        if not steps:
            return
        # The logged loss is the mean over ranks of each rank's mean: carrying the ranks' mean
        # sum gives the same number (exactly so on one process).
        vals = self.acc.reduce(torch.stack([h.loss_sum, h.penalty_sum, h.loss_max, h.bad]),
                               "mean").tolist()
        c.loss_sum, c.penalty_sum = vals[0], vals[1]
        c.bad = int(vals[3])
        c.loss_max = vals[2] if math.isfinite(vals[2]) else 0.0

    def train_step(self, watched: bool):
        """One optimizer step over this rank's micro-batches; returns its LR and gradient norm
        (a device tensor). A non-finite step is skipped on the device, without a host sync
        (see health.py)."""
        net, st, plan = self.net, self.st, self.feed.plan
        lr = lr_at(st.step, **self.feed.lr_args)
        for group in net.optimizer.param_groups:
            group["lr"] = lr * group.get("lr_scale", 1.0)   # Muon's matrices: muon_lr's share
        if watched:
            net.prec.watch(True)  # scale statistics on logged steps only
        step_ce = step_penalty = 0.0
        check = self.parts.gap_check if self.parts.gap_check.due(st.step + 1) else None
        gap = None
        for i in range(plan.accum):   # this rank's slice of the step, one micro-batch at a time
            t_wait = time.perf_counter()
            x, y = self.batches.next()
            self.parts.meter.waited(time.perf_counter() - t_wait)
            x = x.to(self.acc.device, non_blocking=True)
            y = y.to(self.acc.device, non_blocking=True)
            checked = check is not None and i == 0   # fp8_check_interval: the first micro-batch
            if checked:
                check.high_precision(lambda a, b: step_loss(net, a, b), x, y)
            with self.acc.accumulate(net.model):  # no_sync except on the last micro-step
                with net.prec.forward_context(training=True):
                    loss, ce, penalty = step_loss(net, x, y)
                if checked:
                    gap = check.gap_tensor(ce)
                self.acc.backward(loss)            # divides by the accumulation steps
            net.prec.after_backward()
            step_ce = step_ce + ce.detach()
            step_penalty = step_penalty + penalty.detach()
        grad_norm = self.acc.clip_grad_norm_(net.model.parameters(), net.max_norm)
        skip = net.health.step(grad_norm, step_ce / plan.accum, step_penalty / plan.accum)
        net.inner_optimizer.found_inf = skip   # the fused kernel skips it: no host sync
        with net.optimizer_context(), self.parts.meter.optimizer.timed(watched):
            net.optimizer.step()
        net.prec.after_optimizer_step()
        net.optimizer.zero_grad(set_to_none=net.grads_to_none)
        st.step += 1
        st.tokens += self.feed.tokens_per_step
        st.data_position += plan.effective
        self.parts.meter.stepped()
        if gap is not None:   # one host read per check, on every rank (its cost is training's)
            self.log.log(check.report(*self.acc.reduce(gap, "mean").tolist(), st))
        return lr, grad_norm

    def after_log_step(self, lr: float, grad_norm) -> bool:
        """Log the interval (its one host sync); roll back after too many non-finite steps in a
        row. True when the run rolled back."""
        st, net, p = self.st, self.net, self.parts
        vals = self.acc.reduce(net.health.interval(), "mean").tolist()  # host sync
        loss, penalty, bad, loss_max, worst_streak = vals
        row = p.meter.row(st, loss, penalty, lr, float(grad_norm))
        st.skipped_steps += int(bad)
        extra = net.prec.stats()             # rank 0's scales, read in one go
        net.prec.watch(False)
        row.update(p.meter.memory())
        if extra:
            row.update(zip(extra, torch.stack(list(extra.values())).tolist()))
        row["train/skipped_steps"] = int(bad)
        row["train/loss_max"] = loss_max
        self.log.log(row)
        interval = p.meter.last_steps
        if bad:
            self.log.msg(f"step {st.step:,}: {int(bad)} step(s) of the last {interval} had "
                         f"non-finite gradients; their updates were skipped "
                         f"({st.skipped_steps:,} so far)")
        spike = net.health.spike(loss, loss_max)
        if spike:
            self.log.warn(f"loss spike in steps {st.step - interval + 1:,}-{st.step:,}: {spike}")
        if not p.recovery.due(worst_streak):
            return False
        p.meter.pause()
        self.batches.close()
        p.recovery.roll_back(st)
        self.carry_in()
        self.batches = self.feed.stream(st.data_position)
        p.meter.resume()
        return True

    def eval_and_save(self, last: bool, stop_reason, redo: bool = False) -> bool:
        """Evaluate and checkpoint when due; True when the target was reached and the run stops
        there (stop_at_target). `redo`: the evaluation of the step the run resumed at, which a
        stop abandoned (its checkpoint exists: saved again only to record a target)."""
        st, p = self.st, self.parts
        signalled = p.stopper.signalled
        # A signal leaves its time to the checkpoint: an evaluation due now runs on --resume.
        do_eval = redo or (not signalled and
                           p.evaluator.due(st.step, last, bool(stop_reason)))
        do_ckpt = not redo and p.checkpointer.due(st.step, last, bool(stop_reason))
        if not (do_eval or do_ckpt):
            return False
        at_target = False
        p.meter.pause()
        if do_eval:
            reached = p.evaluator.run(self.net.model, st, st.train_seconds + p.meter.banked(),
                                      p.wall, p.stopper, last=last)
            if reached is None:    # abandoned: every rank agreed on a stop signal
                self.note_signal()
                self.log.msg(f"evaluation at step {st.step:,} abandoned: {p.stopper.reason}; "
                             "no val row for it: it runs when the run resumes")
                do_ckpt = not redo
            elif reached:   # a target reached is saved, and with stop_at_target ends the run
                do_ckpt = True
                at_target = p.evaluator.ev.stop_at_target and not last and not stop_reason
        if do_ckpt:
            final = bool(last or p.stopper.reason or at_target)
            if final:   # the steps since the last log line count too
                st.train_seconds += p.meter.collect()
            self.carry_out()
            if p.checkpointer.save(st, final, p.wall(), p.recovery.in_streak):
                p.recovery.saved(st.step)
                if not final:   # a signal during the save: this checkpoint is the stop's
                    p.stopper.interrupts(0)
        p.meter.resume()
        return at_target

    def finish(self, stop_reason, at_target: bool) -> int:
        """The closing line and the end-of-run report (log, summary.json, W&B summary)."""
        st, p = self.st, self.parts
        p.checkpointer.wait(st, final=True)   # a background write in flight: the run's last one
        exit_code = EXIT_STOPPED if p.stopper.signalled else 0
        if exit_code == EXIT_STOPPED:
            self.note_signal()
            self.log.preempting()
        if self.log.progress is not None:
            self.log.progress.close()
        done = f"stopped early: {stop_reason}; resume with --resume" if stop_reason else \
            "stopped at the target (stop_at_target)" if at_target else "done"
        status = "target reached" if at_target else \
            f"stopped: {stop_reason}" if stop_reason else "completed"
        if exit_code == EXIT_STOPPED:
            done += f" (exit {EXIT_STOPPED})"
        skipped = f", {st.skipped_steps:,} non-finite steps skipped" if st.skipped_steps else ""
        rolled = f", {st.rollbacks} rollback(s)" if st.rollbacks else ""
        self.log.msg(f"{done} at step {st.step:,} ({st.tokens:,} tokens, "
                     f"{st.train_seconds / 60:.1f} min of training{skipped}{rolled}); "
                     f"checkpoint {p.checkpointer.latest()}")
        from . import summary
        st.wall_seconds = p.wall()
        device = self.acc.device
        peak_mem = torch.cuda.max_memory_allocated(device) / 1e9 \
            if device.type == "cuda" else None
        report = summary.build(self.run.facts, st, p.evaluator.record, self.net.prec, dict(
            status=status, exit_code=exit_code, final_val=p.evaluator.final,
            latest_checkpoint=p.checkpointer.latest(), peak_memory_gb=peak_mem,
            first_step_s=self.first_step_s, hellaswag=p.evaluator.hellaswag_final,
            **p.gap_check.summary()),
            fp8=self.fp8_facts())
        for line in summary.describe(report):
            self.log.msg(line)
        self.log.summary(self.run.run_dir, report)
        return exit_code

    def fp8_facts(self):
        """What the FP8 verdict needs: the precision as it ended (a recovery may have switched
        FP8 off) and the converted layers' shapes, read from the model without its wrappers
        (DDP, torch.compile) so that the layer names match the selection's."""
        model = self.acc.unwrap_model(self.net.model, keep_torch_compile=False)
        return self.net.prec.report(model)
