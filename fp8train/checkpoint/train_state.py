"""The run's counters: what a checkpoint holds besides the model, optimizer and RNG states, saved
as train_state.json (plain JSON: nothing in it is ever unpickled), beside the state of the
components that own some (`components`: {name: component.state_dict()}: the precision's
remedies, the evaluator's record, the log interval in progress)."""
from __future__ import annotations


class Counters:
    """Named values with a default each, kept as JSON. A subclass sets them in `__init__`; the
    default says what kind a loaded value must be (`load_state_dict`)."""

    def state_dict(self) -> dict:
        return dict(vars(self))

    def load_state_dict(self, d: dict) -> None:
        """The values of `d` (a key it lacks gets its default; unknown keys are ignored).
        ValueError for a value of the wrong kind, before anything is set."""
        if not isinstance(d, dict):
            raise ValueError(f"not an object but {type(d).__name__}")
        loaded = {}
        for key, default in vars(type(self)()).items():
            value = d.get(key, default)
            if not _fits(value, default):
                raise ValueError(f"'{key}' is {value!r}")
            loaded[key] = float(value) if isinstance(default, float) else value
        vars(self).update(loaded)

    to_dict = state_dict

    @classmethod
    def from_dict(cls, d: dict):
        state = cls()
        state.load_state_dict(d)
        return state


class TrainState(Counters):
    """Counters that make a run resumable; saved with every checkpoint as train_state.json."""

    def __init__(self):
        self.step = 0                # optimizer steps done
        self.tokens = 0              # training tokens consumed, all ranks together
        self.data_position = 0       # training sequences drawn, all ranks together
        self.train_seconds = 0.0     # wall time spent training, over all invocations
        self.skipped_steps = 0       # updates skipped for non-finite gradients
        self.rollbacks = 0           # restores of the last checkpoint after max_bad_steps
        # for the end-of-run report (summary.json), carried across resumes
        self.wall_seconds = 0.0      # wall time of every invocation, up to its last checkpoint
        self.steady_tokens = 0       # tokens and training seconds of the steady state (each
        self.steady_seconds = 0.0    # invocation's first log interval, with compile, left out)
        self.checkpoints_written = 0


COMPONENTS = "components"   # train_state.json's key of {name: component.state_dict()}

# Before the components kept their own state, train_state.json held it as counters: component
# -> {its key: the counter's name}. Such checkpoints still resume (`components_of`).
LEGACY = {
    "precision": {"margin_added": "fp8_margin_added", "off": "fp8_off",
                  "off_reason": "fp8_off_reason", "handed_over_tokens": "fp8_until_tokens"},
    "evaluator": {k: k for k in ("best_val_loss", "best_val_step", "target", "target_step",
                                 "time_to_target_s", "tokens_to_target")},
    "interval": {k: f"interval_{k}" for k in ("steps", "bad", "loss_sum", "penalty_sum",
                                              "loss_max")},
}


def components_of(saved: dict) -> dict:
    """{name: state} of the components in a parsed train_state.json. A file written before a
    component kept its own state holds it as counters (LEGACY): read as its state_dict (the
    precision's hand-over then also as `handed_over`). ValueError when the section is not a
    mapping of mappings."""
    found = saved.get(COMPONENTS)
    found = {} if found is None else found
    if not isinstance(found, dict) or not all(isinstance(v, dict) for v in found.values()):
        raise ValueError(f"'{COMPONENTS}' is {found!r}")
    out = {name: dict(state) for name, state in found.items()}
    for name, keys in LEGACY.items():
        old = {new: saved[key] for new, key in keys.items() if saved.get(key) is not None}
        if not old:
            continue
        if name == "precision" and "handed_over_tokens" in old:
            old["handed_over"] = True
        out[name] = {**old, **out.get(name, {})}
    return out


def _fits(value, default) -> bool:
    """A flag takes a bool, a text a str, an int counter an int, a float one any number, the
    values that are None until set (best_val_loss, target_step, ...) None or a number."""
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
