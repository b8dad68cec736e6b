"""What tests/unit/test_plot_run.py and tests/e2e/test_plot_run.py share."""




def figures(run_dir):
    """The run's Plots, as plot_run.py builds them."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from fp8train.analysis import plot as mod
    from fp8train.analysis.metrics_reader import lr_schedule, read_run_config, resume_steps
    return mod, mod.Plots(plt, mod.read_metrics(str(run_dir)), run_dir.name,
                          resumes=resume_steps(str(run_dir)),
                          schedule=lr_schedule(read_run_config(str(run_dir))))


def legend_texts(ax):
    return [t.get_text() for t in ax.get_legend().get_texts()]
