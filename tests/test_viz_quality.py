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
    assert [r.method for r in explorer.reports] == ["int8"]  # measured at once, for the default choice
    assert budget.disabled and on_top.disabled  # a format takes no budget
    method.value = "sink-window"
    assert not budget.disabled
    budget.value = 48
    on_top.value = True
    names = [r.method for r in explorer.reports]
    assert names == ["int8", "sink-window:64", "sink-window:48", "int8+sink-window:48"]
    last = explorer.reports[-1]
    assert last.bytes_vs_fp16 < explorer.reports[2].bytes_vs_fp16  # int8 on top of the press saves more
    assert "live kernel" in repr(explorer)
