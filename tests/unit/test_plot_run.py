"""In-process tests: scripts/plot_run.py and scripts/compare_runs.py on real tiny runs (FP8,
stopped and resumed; fp32) and on broken inputs. The figures are checked by what they show
(lines, labels, ... The whole story, and the tests that start processes:
tests/e2e/test_plot_run.py."""


import json

from support.plot_run_shared import figures, legend_texts


def test_many_layers_name_the_extremes_and_group_the_rest(tmp_path):
    plots = figures_from_rows(tmp_path, [
        {"step": s, "train/loss": 1.0, **{f"fp8/blocks.{i}.mlp.fc/fwd_scale_input": i * s + 1.0
                                         for i in range(20)}} for s in (1, 2)])
    ax = [a for a in plots.fp8_scales(True).axes if a.get_title().startswith("per layer")][0]
    shown = legend_texts(ax)
    extremes = [f"blocks.{i}.mlp.fc" for i in list(range(6)) + list(range(14, 20))]
    assert sorted(shown[:-1]) == sorted(extremes) and shown[-1] == "8 other layers"


def figures_from_rows(tmp_path, rows):
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return figures(tmp_path)[1]
