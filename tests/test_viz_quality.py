"""The KV quality explorer: its menu names the harness's methods, and changing a control re-measures."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

from minipd.viz.quality import method_name, quality_explorer


def test_menu_choices_name_the_harness_methods():
    assert method_name("int4", 64, True) == "int4"  # formats ignore the budget and the box
    assert method_name("snapkv", 96, False) == "snapkv:96"
    assert method_name("sink-window", 64, True) == "int8+sink-window:64"


def test_each_change_measures_the_new_choice_and_keeps_the_last_ones():
    explorer = quality_explorer("tiny-py", window=128)
    controls = explorer.children[0].children
    method, budget, on_top = controls
    # Measured at once, for the default choice: a press, so the budget slider is live from the start.
    assert [r.method for r in explorer.reports] == ["sink-window:64"] and not budget.disabled
    budget.value = 48
    on_top.value = True
    method.value = "int8"
    assert budget.disabled and on_top.disabled  # a format takes no budget
    names = [r.method for r in explorer.reports]
    assert names == ["sink-window:64", "sink-window:48", "int8+sink-window:48", "int8"]
    assert explorer.reports[2].bytes_vs_fp16 < explorer.reports[1].bytes_vs_fp16  # int8 on top of the press
    assert "live kernel" in repr(explorer)
