"""The run's counters: what a checkpoint holds besides the model, optimizer and RNG states, saved
as train_state.json (plain JSON: nothing in it is ever unpickled), beside the state of the
components that own some (`components`: {name: component.state_dict()}, e.g. the precision's
remedies)."""
from __future__ import annotations


class TrainState:
    """Counters that make a run resumable; saved with every checkpoint as train_state.json."""

    def __init__(self):
        self.step = 0                # optimizer steps done
        self.tokens = 0              # training tokens consumed, all ranks together
        self.data_position = 0       # training sequences drawn, all ranks together
        self.train_seconds = 0.0     # wall time spent training, over all invocations
        self.skipped_steps = 0       # updates skipped for non-finite gradients
        self.rollbacks = 0           # restores of the last checkpoint after max_bad_steps
        self.fp8_until_tokens = None  # tokens trained when fp8_until switched FP8 off
        # for the end-of-run report (summary.json), carried across resumes
        self.wall_seconds = 0.0      # wall time of every invocation, up to its last checkpoint
        self.steady_tokens = 0       # tokens and training seconds of the steady state (each
        self.steady_seconds = 0.0    # invocation's first log interval, with compile, left out)
        self.best_val_loss = None
        self.best_val_step = None
        self.target = None           # target_val_loss when it was reached, and where
        self.target_step = None
        self.time_to_target_s = None
        self.tokens_to_target = None
        self.checkpoints_written = 0
        # the log interval a checkpoint between log steps was taken in (carried into the next
        # row on resume): its steps, skipped steps, and the ranks' mean loss sums and loss max
        self.interval_steps = 0
        self.interval_bad = 0
        self.interval_loss_sum = 0.0
        self.interval_penalty_sum = 0.0
        self.interval_loss_max = 0.0

    def to_dict(self) -> dict:
        return dict(vars(self))

    @classmethod
    def from_dict(cls, d: dict) -> "TrainState":
        """The counters of `d`, a parsed train_state.json: a key it lacks keeps its default,
        unknown keys are ignored. ValueError for a value of the wrong kind."""
        if not isinstance(d, dict):
            raise ValueError(f"not an object but {type(d).__name__}")
        state = cls()
        for key, default in vars(cls()).items():
            value = d.get(key, default)
            if not _fits(value, default):
                raise ValueError(f"'{key}' is {value!r}")
            setattr(state, key, float(value) if isinstance(default, float) else value)
        return state


COMPONENTS = "components"   # train_state.json's key of {name: component.state_dict()}


def components_of(saved: dict) -> dict:
    """{name: state} of the components in a parsed train_state.json. Files written before the
    components kept their own state held the precision's as counters (fp8_margin_added,
    fp8_off, fp8_off_reason; the hand-over as fp8_until_tokens): read as its state_dict.
    ValueError when the section is not a mapping of mappings."""
    found = saved.get(COMPONENTS)
    if found is None:
        legacy = ("fp8_margin_added", "fp8_off", "fp8_off_reason")
        if not any(k in saved for k in legacy):
            return {}
        return {"precision": dict(margin_added=saved.get("fp8_margin_added", 0),
                                  off=saved.get("fp8_off", False),
                                  off_reason=saved.get("fp8_off_reason", ""),
                                  handed_over=saved.get("fp8_until_tokens") is not None)}
    if not isinstance(found, dict) or not all(isinstance(v, dict) for v in found.values()):
        raise ValueError(f"'{COMPONENTS}' is {found!r}")
    return found


def _fits(value, default) -> bool:
    """A flag takes a bool, a text a str, an int counter an int, a float one any number, the values that are
    None until set (best_val_loss, target_step, ...) None or a number."""
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if isinstance(default, bool):
        return isinstance(value, bool)
    if isinstance(default, str):
        return isinstance(value, str)
    if isinstance(default, int):
        return number and isinstance(value, int)
    if isinstance(default, float):
        return number
    return value is None or number
