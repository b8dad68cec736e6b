"""The batch: micro-batch × accumulation × world = the effective batch, decided at start.
Nothing is imported here: importing one module loads only the modules it uses.

- plan.py      `BatchPlan` (the arithmetic of an effective batch) and the out-of-memory hint.
- decide.py    the run's plan: as written, the checkpoint's on resume, or probed and timed; the
               run's length in steps.
- fit.py       the largest micro-batch that fits: real training steps of a throw-away model
               (`make_trial`), the memory budget, the ranks' agreement, the cache beside it.
- speed.py     the fastest micro-batch up to the fit: the timing, the rule, the table.
"""
